"""A node's Prometheus metrics, in a registry of its own (several nodes share one process in the tests, and the
global default registry would mix them up).

Two kinds of numbers. What only exists at the moment it happens (latencies, sizes of forward steps, request
outcomes, token counts) is recorded through the small hooks below, called where the event happens. What the node
already counts (sampling batches and fallbacks, peers, requests in flight, KV-cache bytes) is read when Prometheus
scrapes, by `_NodeCollector`, so the hot paths write nothing extra for it.
"""
from __future__ import annotations

import asyncio
import re
import time
from collections import Counter as Tally
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from node.runtime.node import Node

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
OUTCOMES = ("stop", "length", "error", "cancelled", "rejected")
_BATCH_SIZE = re.compile(r"sample_batch_size_(\d+)$")


class NodeMetrics:
    def __init__(self, node: Node):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("exo_requests", "Generation requests this node was the entry of, by endpoint and "
                                "outcome (stop, length, error, cancelled by the client, rejected before generating)",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("exo_prompt_tokens", "Prompt tokens of requests admitted at this entry node",
                                     registry=r)
        self.completion_tokens = Counter("exo_completion_tokens", "Tokens generated for this entry node's requests",
                                         registry=r)
        self.ttft = Histogram("exo_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("exo_inter_token_latency_seconds", "Gap between successive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.step_seconds = Histogram("exo_forward_step_seconds", "Duration of one forward pass over this node's "
                                      "layers", buckets=LATENCY_BUCKETS, registry=r)
        self.step_rows = Histogram("exo_forward_step_rows", "Requests batched into one forward pass",
                                   buckets=SIZE_BUCKETS, registry=r)
        self.rpc_errors = Counter("exo_peer_rpc_errors", "Failed calls to a peer, by peer (node id, or address when "
                                  "unknown) and call", ["peer", "call"], registry=r)
        r.register(_NodeCollector(node))
        self.node = node
        # Counters for the node's `status` (in /v1/topology and health checks), which the web page turns into rates.
        self.status = _Status(lambda: {"kv_cache_bytes": kv_cache_bytes(node)})

    # -- hooks ------------------------------------------------------------------------------------------------
    def step_done(self, seconds: float, rows: int, positions: int) -> None:
        self.step_seconds.observe(seconds)
        self.step_rows.observe(rows)
        self.status.counts["step_positions"] += positions

    def rpc_error(self, address: str, call: str) -> None:
        peer = next((p.node_id for p in self.node.peers.values() if p.address == address), address)
        self.rpc_errors.labels(peer, call).inc()

    def request(self, endpoint: str) -> RequestObserver:
        return RequestObserver(self, endpoint)


class RequestObserver:
    """One generation request at the entry node: `with metrics.request("chat") as obs:` counts its outcome when the
    block exits (however it exits), `obs.tokens(n)` times each token, `obs.watch(pieces)` notes the finish reason."""

    def __init__(self, metrics: NodeMetrics, endpoint: str):
        self.metrics, self.endpoint = metrics, endpoint
        self.started = self.last = time.perf_counter()
        self.count = 0
        self.outcome: str | None = None
        self.was_admitted = False

    def __enter__(self) -> RequestObserver:
        return self

    def __exit__(self, kind, error, tb) -> None:
        from node.http.schema import ApiError

        outcome = self.outcome
        if kind is None:
            outcome = outcome or "error"  # a stream that ended without a finish reason
        elif issubclass(kind, ApiError):
            outcome = outcome or ("error" if self.was_admitted else "rejected")  # e.g. 400 or 503 overloaded
        elif issubclass(kind, (asyncio.CancelledError, ConnectionError)):
            outcome = "cancelled"  # the client went away; aiohttp cancels the handler
        else:
            outcome = outcome or "error"
        self.metrics.requests.labels(self.endpoint, outcome).inc()

    def admitted(self, prompt_tokens: int) -> None:
        self.was_admitted = True
        self.metrics.prompt_tokens.inc(prompt_tokens)

    def tokens(self, n: int) -> None:
        """`n` tokens arrived together (almost always one): a gap shared by several counts once per token."""
        now = time.perf_counter()
        if self.count == 0:
            self.metrics.ttft.observe(now - self.started)
            n_gaps, gap = n - 1, 0.0
        else:
            n_gaps, gap = n, (now - self.last) / n
        for _ in range(n_gaps):
            self.metrics.itl.observe(gap)
        self.count += n
        self.last = now
        self.metrics.completion_tokens.inc(n)

    async def watch(self, pieces: AsyncIterator) -> AsyncIterator:
        """Pass text pieces through, noting the finish reason, or "error" when the generation fails."""
        try:
            async for piece in pieces:
                if piece.finish_reason is not None:
                    self.outcome = piece.finish_reason
                yield piece
        except Exception:
            self.outcome = "error"
            raise
        finally:
            await pieces.aclose()


class _Status(Mapping):
    """Counters plus the node's own clock: a reader turns two snapshots into exact rates with it, however late the
    snapshots travel (a peer's status reaches the page through a health check)."""

    def __init__(self, live: Callable[[], dict[str, int]]):
        self.counts: Tally[str] = Tally()
        self.live = live  # values read when the status is
        self._start = time.monotonic()

    def _items(self) -> dict[str, int]:
        return {**self.counts, **self.live(), "uptime_ms": int((time.monotonic() - self._start) * 1000)}

    def __getitem__(self, key: str) -> int:
        return self._items()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    def items(self):
        return self._items().items()


def kv_cache_bytes(node: Node) -> int:
    """Bytes held by every KV cache of the node's engines. The engine thread adds and drops caches meanwhile; a
    dict that changes while it is summed raises, and the next try gets a consistent view."""
    total = 0
    for engine in list(node.shards.engines.values()):
        measure = getattr(engine, "cache_bytes", None)
        for _ in range(5):
            try:
                total += measure() if measure else 0
                break
            except RuntimeError:
                continue
    return total


class _NodeCollector(Collector):
    """Read at scrape time from the counters the node keeps anyway."""

    def __init__(self, node: Node):
        self.node = node

    def collect(self):
        node = self.node
        stats = node.batcher.stats
        yield _gauge("exo_requests_in_flight", "Requests this node holds state for (as entry, in its layers, or "
                     "in a KV cache)", node.info().active_requests)
        yield _gauge("exo_kv_cache_bytes", "Memory held by KV caches", kv_cache_bytes(node))
        yield _gauge("exo_weights_bytes", "Memory held by loaded weights",
                     sum(e.nbytes() for e in list(node.shards.engines.values())))
        yield _gauge("exo_peers", "Peers that answer health checks", len(node.peers))
        yield _counter("exo_peers_joined", "Peers that joined", node.counters["peers_joined"])
        yield _counter("exo_peers_left", "Peers that left", node.counters["peers_left"])
        ended = CounterMetricFamily("exo_node_requests_ended", "Requests this node took part in that ended, by "
                                    "reason", labels=["reason"])
        for key, value in sorted(node.core.counters.items()):
            if key.startswith("ended_"):
                ended.add_metric([key.removeprefix("ended_")], value)
        yield ended
        yield _batch_sizes(stats)
        yield _counter("exo_sampling_rows", "Rows (tokens) sampled on this node", stats["sample_items"])
        yield _counter("exo_sampling_calls", "Sampler calls (one per batch, or per row on a fallback)",
                       stats["sample_calls"])
        yield _counter("exo_sampling_fallbacks", "Rows sampled one by one because their batch could not be sampled "
                       "in one call", stats["sample_fallbacks"])
        yield _counter("exo_sampling_errors", "Rows whose sampling failed", stats["sample_errors"])


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _batch_sizes(stats: Mapping[str, int]) -> HistogramMetricFamily:
    """The batcher's per-size counts (`sample_batch_size_N`) as a histogram: the counts are exact, so is the sum."""
    sizes = {int(m.group(1)): n for key, n in stats.items() if (m := _BATCH_SIZE.match(key))}
    buckets = [(str(le), sum(n for size, n in sizes.items() if size <= le)) for le in SIZE_BUCKETS]
    buckets.append(("+Inf", sum(sizes.values())))
    return HistogramMetricFamily("exo_sampling_batch_size", "Rows per sampling batch", buckets=buckets,
                                 sum_value=sum(size * n for size, n in sizes.items()))
