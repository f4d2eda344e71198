"""A node's Prometheus metrics, in a registry of its own (several nodes share one process in the tests, and the
global default registry would mix them up).

Two kinds of numbers. What only exists at the moment it happens (latencies, sizes of forward steps, request
outcomes, token counts) is recorded through the small hooks below, called where the event happens. What the node
already counts (sampling batches and fallbacks, peers, requests in flight, KV-cache bytes) is read when Prometheus
scrapes, by `_NodeCollector` from the node's `NodeStatus` snapshot, so the hot paths write nothing extra for it.

The metrics know the node only through the callables handed to their constructor: the node owns the metrics, never
the reverse (no import of node.py here), and they know nothing of HTTP (the API says which errors are refusals).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
OUTCOMES = ("stop", "length", "error", "cancelled", "rejected")
_BATCH_SIZE = re.compile(r"sample_batch_size_(\d+)$")
_TRIP_TOKENS = re.compile(r"tokens_per_trip_(\d+)$")
TRIP_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32)
SPECULATION_METRICS = {
    "spec_proposed": ("exo_speculative_proposed", "Proposed tokens this node verified as a last node"),
    "spec_accepted": ("exo_speculative_accepted", "Of those, the tokens accepted (the output is the same either way)"),
    "spec_trips": ("exo_speculative_trips", "Steps with proposals this node verified"),
}


PREFIX_METRICS = {
    "prefix_hits": "Requests this entry started from a prefix the nodes of their plan retained",
    "prefix_hit_tokens": "Prompt positions those requests did not compute again",
    "prefix_fallbacks": "Requests this entry prefilled in full because a node of the plan no longer held the prefix",
    "prefix_gone": "Requests this node refused because it no longer held the prefix they asked for",
    "prefix_evictions": "Retained caches this node freed to make room for reservations",
}


@dataclass(frozen=True)
class NodeStatus:
    """A snapshot of what a node counts anyway (`Node.status()`), read when Prometheus scrapes."""

    active_requests: int  # requests it holds state for: as entry, in its layers, or in a KV cache
    peers: int  # live peers
    peers_joined: int
    peers_left: int
    kv_cache_bytes: int
    weights_bytes: int
    ended: Mapping[str, int]  # requests it took part in that ended, by reason
    sampling: Mapping[str, int]  # the sampling batcher's counts (sample_items, sample_batch_size_N, ...)
    prefix: Mapping[str, int] = field(default_factory=dict)  # prefix reuse: prefix_hits, prefix_hit_tokens, ...
    speculation: Mapping[str, int] = field(default_factory=dict)  # spec_proposed, spec_accepted, tokens_per_trip_N


class NodeMetrics:
    def __init__(
        self, *, status: Callable[[], NodeStatus], kv_cache_bytes: Callable[[], int], name_of: Callable[[str], str]
    ):
        """`status`: the node's snapshot; `kv_cache_bytes`: the one live number the node's own status carries;
        `name_of`: a peer's node id from its address (the address itself when unknown)."""
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "exo_requests",
            "Generation requests this node was the entry of, by endpoint and "
            "outcome (stop, length, error, cancelled by the client, rejected before generating)",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "exo_prompt_tokens", "Prompt tokens of requests admitted at this entry node", registry=r
        )
        self.completion_tokens = Counter(
            "exo_completion_tokens", "Tokens generated for this entry node's requests", registry=r
        )

        def latency(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = latency("exo_time_to_first_token_seconds", "From a request's arrival to its first token")
        self.itl = latency("exo_inter_token_latency_seconds", "Gap between successive tokens of a request")
        self.step_seconds = latency("exo_forward_step_seconds", "Duration of one forward pass over this node's layers")
        self.step_rows = Histogram(
            "exo_forward_step_rows", "Requests batched into one forward pass", buckets=SIZE_BUCKETS, registry=r
        )
        self.loop_lag = latency(
            "exo_event_loop_lag_seconds",
            "How late the node's event loop woke a task that asked to wake (sampled every 0.1 s): while it is held, "
            "the API, gRPC and health checks wait",
        )
        self.rpc_errors = Counter(
            "exo_peer_rpc_errors",
            "Failed calls to a peer, by peer (node id, or address when unknown) and call",
            ["peer", "call"],
            registry=r,
        )
        r.register(_NodeCollector(status))
        self.name_of = name_of
        # Counters for the node's `status` (in /v1/topology and health checks), which the web page turns into rates.
        self.status = _Status(lambda: {"kv_cache_bytes": kv_cache_bytes()})

    # -- hooks ------------------------------------------------------------------------------------------------
    def step_done(self, seconds: float, rows: int, positions: int) -> None:
        self.step_seconds.observe(seconds)
        self.step_rows.observe(rows)
        self.status.counts["step_positions"] += positions

    def rpc_error(self, address: str, call: str) -> None:
        self.rpc_errors.labels(self.name_of(address), call).inc()

    def request(self, endpoint: str, *, refusals: tuple[type[BaseException], ...] = ()) -> RequestObserver:
        """`refusals`: the errors that refuse a request (the API's 4xx/5xx answers): "rejected" before the request
        was admitted, "error" after."""
        return RequestObserver(self, endpoint, refusals)


class RequestObserver:
    """One generation request at the entry node: `with metrics.request("chat") as obs:` counts its outcome when the
    block exits (however it exits), `obs.tokens(n)` times each token, and `outcome` is its finish reason or "error"
    (node/http/pieces.py notes it)."""

    def __init__(self, metrics: NodeMetrics, endpoint: str, refusals: tuple[type[BaseException], ...] = ()):
        self.metrics, self.endpoint, self.refusals = metrics, endpoint, refusals
        self.started = self.last = time.perf_counter()
        self.count = 0
        self.outcome: str | None = None
        self.was_admitted = False

    def __enter__(self) -> RequestObserver:
        return self

    def __exit__(self, kind, error, tb) -> None:
        outcome = self.outcome
        if kind is None:
            outcome = outcome or "error"  # a stream that ended without a finish reason
        elif issubclass(kind, self.refusals):
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


class _NodeCollector(Collector):
    """Read at scrape time from the counters the node keeps anyway."""

    def __init__(self, status: Callable[[], NodeStatus]):
        self.status = status

    def collect(self):
        now = self.status()
        stats = now.sampling
        yield _gauge(
            "exo_requests_in_flight",
            "Requests this node holds state for (as entry, in its layers, or in a KV cache)",
            now.active_requests,
        )
        yield _gauge("exo_kv_cache_bytes", "Memory held by KV caches", now.kv_cache_bytes)
        yield _gauge("exo_weights_bytes", "Memory held by loaded weights", now.weights_bytes)
        yield _gauge("exo_peers", "Peers that answer health checks", now.peers)
        yield _counter("exo_peers_joined", "Peers that joined", now.peers_joined)
        yield _counter("exo_peers_left", "Peers that left", now.peers_left)
        ended = CounterMetricFamily(
            "exo_node_requests_ended", "Requests this node took part in that ended, by reason", labels=["reason"]
        )
        for reason, value in sorted(now.ended.items()):
            ended.add_metric([reason], value)
        yield ended
        yield _batch_sizes(stats)
        for key, (name, doc) in SPECULATION_METRICS.items():
            yield _counter(name, doc, now.speculation.get(key, 0))
        yield _sizes(
            now.speculation,
            _TRIP_TOKENS,
            TRIP_BUCKETS,
            "exo_tokens_per_trip",
            "Tokens one trip around the ring brought a request, as its last node sent them (speculation: more than 1)",
        )
        for key, doc in PREFIX_METRICS.items():
            yield _counter(f"exo_{key}", doc, now.prefix.get(key, 0))
        yield _gauge(
            "exo_kv_retained_bytes",
            "Memory held by finished requests' KV caches kept for prefix reuse "
            "(freed first when reservations need the room)",
            now.prefix.get("retained_bytes", 0),
        )
        yield _gauge(
            "exo_kv_retained_branches",
            "Of those caches, the ones held only past the blocks they share with another (a prefix held once)",
            now.prefix.get("retained_branches", 0),
        )
        yield _counter("exo_sampling_rows", "Rows (tokens) sampled on this node", stats["sample_items"])
        yield _counter(
            "exo_sampling_calls", "Sampler calls (one per batch, or per row on a fallback)", stats["sample_calls"]
        )
        yield _counter(
            "exo_sampling_picked",
            "Of those rows, greedy ones whose token the engine picked where their logits were (no logits copied out)",
            stats.get("sample_picked", 0),
        )
        yield _counter(
            "exo_sampling_drawn",
            "Of those rows, top-k ones drawn from the best logits the engine took on its device (no logits copied out)",
            stats.get("sample_drawn", 0),
        )
        yield _counter(
            "exo_sampling_fallbacks",
            "Rows sampled one by one because their batch could not be sampled in one call",
            stats["sample_fallbacks"],
        )
        # A grammar that fails while sampling is a row whose sampling failed too (the batcher counts it apart).
        yield _counter(
            "exo_sampling_errors",
            "Rows whose sampling failed (the sampler, or the grammar constraining the row)",
            stats.get("sample_errors", 0) + stats.get("sample_grammar_errors", 0),
        )
        yield _counter(
            "exo_sampling_grammar_errors",
            "Of those, rows whose grammar failed (a schema admission could not rule out)",
            stats.get("sample_grammar_errors", 0),
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _batch_sizes(stats: Mapping[str, int]) -> HistogramMetricFamily:
    """The batcher's per-size counts (`sample_batch_size_N`) as a histogram: the counts are exact, so is the sum."""
    return _sizes(stats, _BATCH_SIZE, SIZE_BUCKETS, "exo_sampling_batch_size", "Rows per sampling batch")


def _sizes(
    stats: Mapping[str, int], key: re.Pattern, bounds: tuple[int, ...], name: str, doc: str
) -> HistogramMetricFamily:
    """Exact per-size counts (keys `key` matches, the size its group) as a histogram."""
    sizes = {int(m.group(1)): n for k, n in stats.items() if (m := key.match(k))}
    buckets = [(str(le), sum(n for size, n in sizes.items() if size <= le)) for le in bounds]
    buckets.append(("+Inf", sum(sizes.values())))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=sum(size * n for size, n in sizes.items()))
