"""The node process's engine room: drives the transport-free core (node/core/node_core.py) with the engine thread, the
sampling batcher and a transport, and serves as the entry node of the requests its API receives.

All work that reaches a node is queued in the core, and the worker runs what the core picks in one forward pass,
so concurrent requests batch at every stage of the pipeline.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shards.formats.config import ModelConfig
from shards.engines.base import Engine
from shards.partition import PartitionError
from shards.shard import Shard
from shards.tokenizer import Tokenizer

from node.core.node_core import Action, CoreLimits, Deliver, NodeCore, Release, Sample, Send
from node.runtime.entry import Entry
from node.runtime.metrics import NodeMetrics
from node.runtime.outbox import Outbox
from node.core.plan import Busy, PlanError, PlanStep, RequestSpec
from node.core.placement import plan_ring
from node.core.requests import Activation, Refusal, TokenMessage
from node.runtime.sampling_batcher import BatcherClosed, SampleItem, SamplingBatcher
from node.core.scheduler import Group, SchedulerLimits
from node.runtime.shard_manager import EngineFactory, ShardManager
from node.core.topology import Availability, Capabilities, NodeInfo, PeerLink, Topology
from node.runtime.transport import Transport, TransportError

log = logging.getLogger(__name__)
LOCAL_WAIT_S = 0.02  # longest the worker holds queued work back for a one-node ring's tokens in flight


@dataclass(frozen=True)
class NodeSettings:
    node_id: str
    model_dir: Path
    model_id: str
    address: str  # host:port other nodes use to reach this node's gRPC server
    memory_bytes: int
    engine: str = "numpy"
    pinned: tuple[int, int] | None = None
    max_tensor_bytes: int = 255 * 1024 * 1024
    request_timeout: float = 300.0  # the entry gives up after this long without a token
    max_requests: int = 256  # concurrent requests a node takes part in
    sample_batch_max: int = 8  # sampling batcher: rows per batch ...
    sample_batch_window_ms: float = 5.0  # ... or this long after the batch's first row
    max_replays: int = 2  # the entry replays a request on a new plan at most this often when it loses a node
    request_idle_timeout: float = 60.0  # forget a request whose next input doesn't come for this long
    scheduling: SchedulerLimits = SchedulerLimits()  # what one forward pass carries
    kv_budget: int | None = None  # bytes of KV cache this node may reserve for requests (None: no limit)
    kv_value_bytes: int = 4  # bytes per cached key/value element in this node's engine
    queue_timeout: float = 30.0  # the entry retries a request that found no room for this long, then gives up


class Node:
    def __init__(self, settings: NodeSettings, config: ModelConfig, tokenizer: Tokenizer, factory: EngineFactory,
                 transport: Transport, stat_sources: Iterable[Mapping[str, int]] = ()):
        self.settings, self.config, self.tokenizer = settings, config, tokenizer
        self.id, self.address, self.max_tensor_bytes = settings.node_id, settings.address, settings.max_tensor_bytes
        self.known: dict[str, str] = {self.id: self.address}  # every member that answers, draining ones too
        self.core = NodeCore(self.id, settings.model_id, config,
                             CoreLimits(max_requests=settings.max_requests, kv_budget=settings.kv_budget,
                                        kv_value_bytes=settings.kv_value_bytes,
                                        idle_timeout=settings.request_idle_timeout), settings.scheduling,
                             members=lambda: self.known)
        self.shards = ShardManager(settings.model_dir, config, factory)
        self.batcher = SamplingBatcher(settings.sample_batch_max, settings.sample_batch_window_ms,
                                       executor=self.shards.executor)
        self.transport = _Loopback(self, transport)
        self.counters: Counter[str] = Counter()
        self.peers: dict[str, NodeInfo] = {}  # the live peers new plans may use, as membership last saw them
        # The layers this node can serve: all, unless it fetches its weights from a peer (node/fetch/follow.py).
        self.availability: Callable[[], Availability] = Availability
        self.core.serves = lambda shard: self.availability().can_serve(shard)
        self.entry = Entry(self.id, self.address, self.transport, self.make_plan, tokenizer.eos_token_ids,
                           settings.request_timeout, settings.max_replays, settings.queue_timeout, self.counters,
                           self._spawn)
        self.metrics = NodeMetrics(self)
        self.stat_sources = [self.counters, self.core.counters, self.batcher.stats, self.metrics.status,
                             *stat_sources]
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._worker: asyncio.Task | None = None
        self._outboxes: dict[str, Outbox] = {}

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._worker = asyncio.create_task(self._work_loop(), name="pipeline-worker")
        self._spawn(self._expire_loop())

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.settings.request_idle_timeout / 4))
            self._do(self.core.expire())

    async def stop(self) -> None:
        tasks = [t for t in [self._worker, *self._tasks] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.batcher.close()
        self.shards.close()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- what this node is, and who its peers are -------------------------------------------------------------
    def info(self) -> NodeInfo:
        s = self.settings
        return NodeInfo(
            node_id=self.id,
            address=self.address,
            capabilities=Capabilities(s.memory_bytes, s.engine, s.model_id, self.config.n_layers),
            pinned=s.pinned,
            loaded=self.shards.loaded,
            active_requests=self.core.active + self.entry.active + self.shards.active_requests,
            status={k: v for source in self.stat_sources for k, v in source.items()},
            draining=self.draining,
            availability=self.availability(),
        )

    @property
    def draining(self) -> bool:
        return self.core.draining

    def start_draining(self) -> None:
        """Shutting down: take no new request; the ones in flight run to their end (or are replayed elsewhere by
        their entry nodes once this node is gone)."""
        self.core.draining = True

    async def drained(self) -> None:
        """Returns once this node holds no request any more, as entry or as a member of a plan, and has sent what
        it owes its peers (a request's last token leaves after the request has ended here)."""
        while self.core.active or self.entry.active or self._outboxes:
            await asyncio.sleep(0.05)

    def topology(self) -> Topology:
        peers = tuple(sorted(self.peers.values(), key=lambda n: n.node_id))
        return Topology(nodes=(self.info(), *peers), links=tuple(PeerLink(self.id, p.node_id) for p in peers))

    def update_peers(self, peers: dict[str, NodeInfo], alive: dict[str, str]) -> None:
        """Membership's latest view: the peers new plans may use, and every peer that answered (draining ones too)
        with its address. Requests we are the entry of lose the nodes that did not answer."""
        self.known = {self.id: self.address} | alive
        self.entry.nodes_alive(self.known.keys())
        for gone in self.peers.keys() - peers.keys():
            log.info("peer %s left", gone)
            self.counters["peers_left"] += 1  # its connection is closed by membership, once it stops answering
        for new in peers.keys() - self.peers.keys():
            log.info("peer %s joined at %s", new, peers[new].address)
            self.counters["peers_joined"] += 1
        self.peers = peers

    def make_pinned_shard(self) -> Shard:
        start, end = self.settings.pinned
        return Shard(self.settings.model_id, start, end, self.config.n_layers)

    def peer_leaving(self, node_id: str, caller: str | None = None) -> None:
        """A peer said it is shutting down: plan without it from now on (its requests in flight go on)."""
        if caller is not None and caller != node_id:
            return  # only a node itself may say it leaves
        if self.peers.pop(node_id, None) is not None:
            log.info("peer %s is leaving", node_id)
            self.counters["peers_left"] += 1

    def make_plan(self, excluded: Collection[str] = ()) -> tuple[PlanStep, ...]:
        """Partition the layers over this node and the peers serving the same model, leaving out `excluded` nodes
        (and this node while it drains), and nodes for layers they don't hold yet (node/core/placement.py)."""
        me = self.info()
        nodes = {} if self.draining else {me.node_id: me}
        nodes |= {
            n.node_id: n for n in self.peers.values()
            if (n.capabilities.model_id, n.capabilities.n_layers) == (self.settings.model_id, self.config.n_layers)
        }
        nodes = {node_id: n for node_id, n in nodes.items() if node_id not in excluded}
        try:
            ring = plan_ring(list(nodes.values()), self.settings.model_id, self.config.n_layers)
        except PartitionError as e:
            raise PlanError(str(e)) from None
        return tuple(PlanStep(node_id, nodes[node_id].address, shard) for node_id, shard in ring)

    # -- what peers send (the transport's server side calls these) --------------------------------------------
    # `caller`: the member calling, authenticated by mutual TLS (None without a cluster key, or when it is us).
    def accept_prompt(self, spec: RequestSpec, tokens: np.ndarray, caller: str | None = None) -> None:
        self.core.accept_prompt(spec, tokens, caller)
        self._wake.set()

    def accept_activations(self, activations: list[Activation], caller: str | None = None) -> list[Refusal]:
        rejected = self.core.accept_activations(activations, caller)
        self._wake.set()
        return rejected

    def accept_tokens(self, message: TokenMessage, caller: str | None = None) -> None:
        self.entry.accept_tokens(message, caller)

    def end_request(self, request_id: str, reason: str, caller: str | None = None) -> None:
        self._do(self.core.end_request(request_id, reason, caller))

    # -- the pipeline worker ----------------------------------------------------------------------------------
    async def _work_loop(self) -> None:
        while True:
            if not self.core.queue or self.core.should_wait:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), LOCAL_WAIT_S if self.core.queue else None)
                    continue
                except asyncio.TimeoutError:
                    self.core.stop_waiting()
            for group in self.core.take_batch():
                try:
                    await self._run(group)
                except Exception as e:  # a bug: fail this batch's requests, keep serving the others
                    log.exception("pipeline step failed")
                    for item in group.items:
                        self._do(self.core.fail(item.request_id, f"node {self.id}: internal error: {e}"))

    async def _run(self, group: Group) -> None:
        try:
            engine = await self.shards.get(group.shard)
        except Exception as e:
            for item in group.items:
                self._do(self.core.fail(item.request_id, f"node {self.id} cannot load {group.shard}: {e}"))
            return
        requests = self.core.requests
        inputs = [(i.request_id, i.data, _positions(requests[i.request_id].spec)) for i in group.items
                  if i.request_id in requests]  # not ended meanwhile
        if not inputs:
            return
        started = time.perf_counter()
        try:
            outputs, refused, computed = await self.shards.forward(engine, inputs)
        except Exception as e:
            log.exception("forward failed")
            for rid, _, _ in inputs:
                self._do(self.core.fail(rid, f"node {self.id}: forward failed: {e}"))
            return
        # forward_us: the engine computing; step_us: the same step as the pipeline saw it (waiting for the engine
        # thread included). Their difference, and the time between steps, is overhead.
        self.core.queue.observe(group, computed)
        self.counters["forward_us_total"] += int(computed * 1e6)
        self.counters["step_us_total"] += int((time.perf_counter() - started) * 1e6)
        self.metrics.step_done(time.perf_counter() - started, len(inputs), sum(len(data) for _, data, _ in inputs))
        errors = {rid: f"node {self.id}: {why}" for rid, why in refused.items()}
        self._do(self.core.step_done(group, outputs, errors), engine)

    # -- carrying out the core's actions ----------------------------------------------------------------------
    def _do(self, actions: list[Action], engine: Engine | None = None) -> None:
        samples: dict[str, asyncio.Future] = {}
        for action in actions:
            if isinstance(action, Release):
                self.shards.release(action.request_id)
            elif isinstance(action, Send):
                self._outbox(action.address).put(*action.activations)
            elif isinstance(action, Deliver):
                self._outbox(action.address).put(action.message)
            elif isinstance(action, Sample):
                item = SampleItem(action.request_id, action.logits, action.params, action.state, engine,
                                  self.settings.model_id)
                try:
                    samples[action.request_id] = self.batcher.submit(item)
                except (ValueError, BatcherClosed) as e:
                    self._do(self.core.fail(action.request_id, f"node {self.id}: cannot sample: {e}"))
        if samples:
            if not self.core.queue:
                self.batcher.flush()  # no more forward passes queued here: nothing else can join this batch
            self._spawn(self._sampled(samples))

    async def _sampled(self, futures: dict[str, asyncio.Future]) -> None:
        results = await asyncio.gather(*futures.values(), return_exceptions=True)
        self._do(self.core.sampled(dict(zip(futures, results))))

    def _outbox(self, address: str) -> Outbox:
        """The ordered outbox for `address` (activations and token messages alike, so a last node whose entry is
        also the first node sends it the token and its delivery in one call); gone again once it is empty."""
        box = self._outboxes.get(address)
        if box is None:
            box = self._outboxes[address] = Outbox(lambda batch: self._send(address, batch), self._spawn,
                                                   lambda: self._outboxes.pop(address, None))
        return box

    async def _send(self, address: str, batch: tuple[Activation | TokenMessage, ...]) -> None:
        activations = tuple(m for m in batch if isinstance(m, Activation))
        messages = tuple(m for m in batch if isinstance(m, TokenMessage))
        try:
            refused = await self.transport.send(address, activations, messages)
        except Exception as e:  # a transport error, or a message that can't be sent: its requests fail, never vanish
            if not isinstance(e, TransportError):
                log.exception("sending to %s failed", address)
            self.metrics.rpc_error(address, "send")
            self._do(self.core.send_failed(address, activations, str(e), isinstance(e, TransportError) and e.retryable))
            for message in messages:
                self._do(self.core.deliver_failed(message, str(e)))
            return
        self._do(self.core.refused(address, refused))


def _positions(spec: RequestSpec) -> int | None:
    """The most positions a request's KV cache will hold, when the spec says (it sizes the cache once)."""
    return spec.positions if spec.prompt_tokens else None


class _Loopback:
    """The transport, except that calls addressed to this very node are handed to it directly: a one-node ring (or
    an entry that is also the last node) needs no network round trip."""

    def __init__(self, node: Node, transport: Transport):
        self.node, self.inner = node, transport

    async def send_prompt(self, address: str, spec: RequestSpec, tokens: np.ndarray) -> None:
        if address != self.node.address:
            return await self.inner.send_prompt(address, spec, tokens)
        try:
            self.node.accept_prompt(spec, tokens)
        except PlanError as e:
            raise TransportError("busy" if isinstance(e, Busy) else "refused", str(e)) from None

    async def send(self, address: str, activations: tuple[Activation, ...], messages: tuple[TokenMessage, ...]) \
            -> list[Refusal]:
        if address != self.node.address:
            return await self.inner.send(address, activations, messages)
        for message in messages:
            self.node.accept_tokens(message)
        return self.node.accept_activations(list(activations)) if activations else []

    async def end_request(self, address: str, request_id: str, reason: str) -> None:
        if address != self.node.address:
            return await self.inner.end_request(address, request_id, reason)
        self.node.end_request(request_id, reason)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # health_check, forget, close
