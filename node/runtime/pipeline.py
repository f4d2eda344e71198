"""The pipeline: runs the forward passes the core schedules, and carries out the actions the core answers with
(`Send` and `Deliver` -> an ordered outbox per address, `Sample` -> the sampling batcher, `Release` -> the shard
manager), feeding every outcome back to the core. The core decides; this only does, so all the decisions stay
testable without threads, sockets or engines (node/core/node_core.py).

All work that reaches a node is queued in the core, and the worker runs what the core picks in one forward pass,
so concurrent requests batch at every stage of the pipeline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from node.core.actions import Action, Deliver, Release, Sample, Send
from node.core.node_core import NodeCore
from node.core.plan import RequestSpec
from node.core.requests import Activation, TokenMessage
from node.core.scheduler import Group
from node.runtime.metrics import NodeMetrics
from node.runtime.outbox import Outbox
from node.runtime.sampling_batcher import BatcherClosed, SampleItem, SamplingBatcher
from node.runtime.shard_manager import PREFIX_GONE, ShardManager
from node.runtime.transport import Transport, TransportError
from shards.engines.base import Engine

log = logging.getLogger(__name__)
RETAIN_WITHOUT_BUDGET = 1 << 30  # retained caches' bytes on a node without --kv-memory-gb
LOCAL_WAIT_S = 0.02  # longest the worker holds queued work back for a one-node ring's tokens in flight
MESSAGE_ROOM = 1 << 20  # of a peer's message bound, what a call leaves for framing
ITEM_ROOM = 8 << 10  # per item of a call: its spec (plan, sampling) or its results (top logprobs), generously


class Pipeline:
    def __init__(
        self,
        core: NodeCore,
        shards: ShardManager,
        batcher: SamplingBatcher,
        transport: Transport,
        *,
        model_id: str,
        metrics: NodeMetrics,
        spawn: Callable[..., object],
    ):
        """`transport`: where `Send`s and `Deliver`s go (this node's own address included: the node hands it a
        transport that loops those back); `spawn` runs a coroutine as a task the node owns (and cancels on stop)."""
        self.core, self.shards, self.batcher, self.transport = core, shards, batcher, transport
        self.model_id, self.metrics, self.spawn = model_id, metrics, spawn
        self.counters: Counter[str] = Counter()  # forward_us_total, step_us_total, presampled_rows
        self._wake = asyncio.Event()
        self._outboxes: dict[str, Outbox] = {}

    @property
    def sending(self) -> bool:
        """Whether messages are still on their way out (a request's last token leaves after it ended here)."""
        return bool(self._outboxes)

    def wake(self) -> None:
        """New work was queued in the core."""
        self._wake.set()

    # -- the worker -------------------------------------------------------------------------------------------
    async def work(self) -> None:
        core = self.core
        while True:
            if not core.queue or core.should_wait:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), LOCAL_WAIT_S if core.queue else None)
                    continue
                except TimeoutError:
                    core.stop_waiting()
            for group in core.take_batch():
                try:
                    await self._run(group)
                except Exception as e:  # a bug: fail this batch's requests, keep serving the others
                    log.exception("pipeline step failed")
                    for item in group.items:
                        self.do(core.fail(item.request_id, f"node {core.id}: internal error: {e}"))
            # the pass's rows are all in the sampling batch: sample now, not after the window (the next pass, a
            # micro-batch or a prompt chunk, takes longer than the window anyway)
            self.batcher.flush()

    async def _run(self, group: Group) -> None:
        me = self.core.id
        try:
            engine = await self.shards.get(group.shard)
        except Exception as e:
            for item in group.items:
                self.do(self.core.fail(item.request_id, f"node {me} cannot load {group.shard}: {e}"))
            return
        if any(item.propose for item in group.items):
            group = await self._proposals(group)
        requests = self.core.requests
        inputs = [
            (i.request_id, i.data, _positions(requests[i.request_id].spec))
            for i in group.items
            if i.request_id in requests
        ]  # not ended meanwhile
        if not inputs:
            return
        reuse = {
            rid: (spec.reuse_from, spec.reuse_positions)
            for rid, _, _ in inputs
            if (spec := requests[rid].spec).reuse_from
        }
        starts = {i.request_id: i.start for i in group.items if i.start is not None}
        every_row = frozenset(i.request_id for i in group.items if i.proposals)
        presampled = Presampled()
        then = self._presampler(group, engine, presampled) if group.shard.is_last else None
        started = time.perf_counter()
        try:
            outputs, refused, computed = await self.shards.forward(
                engine, inputs, reuse, self._retain_limit(), starts=starts, every_row=every_row, then=then
            )
        except Exception as e:
            log.exception("forward failed")
            for rid, _, _ in inputs:
                self.do(self.core.fail(rid, f"node {me}: forward failed: {e}"))
            return
        # forward_us: the engine computing; step_us: the same step as the pipeline saw it (waiting for the engine
        # thread included). Their difference, and the time between steps, is overhead.
        self.core.queue.observe(group, computed)
        self.counters["prefix_evictions"] = self.shards.retained_evictions()
        self.counters["forward_us_total"] += int(computed * 1e6)
        self.counters["step_us_total"] += int((time.perf_counter() - started) * 1e6)
        self.metrics.step_done(time.perf_counter() - started, len(inputs), sum(len(data) for _, data, _ in inputs))
        for rid in [rid for rid, why in refused.items() if why.startswith(PREFIX_GONE)]:
            # the entry prefills the whole prompt instead (it retries a busy request at once when it asked for reuse)
            self.counters["prefix_gone"] += 1
            self.do(self.core.fail(rid, f"node {me}: {refused.pop(rid)}", busy=True))
        errors = {rid: f"node {me}: {why}" for rid, why in refused.items()}
        self.batcher.record(presampled.counts)
        self.do(self.core.step_done(group, outputs, errors), engine, presampled)
        if prefills := self.core.draft_prefills(group):  # a draft model reads the prompts while the ring computes
            self.spawn(self.shards.run(self.core.speculation.prefill, prefills))

    async def _proposals(self, group: Group) -> Group:
        """A deferred proposer's drafts (a draft model) for the group's inputs that asked, computed on the engine
        thread (never on the event loop), then the group as it runs, with them (node/core/speculation.py)."""
        core, asks = self.core, []
        for item in group.items:
            req = core.requests.get(item.request_id)
            if item.propose and req is not None and req.history is not None:
                asks.append((item.request_id, list(req.history), item.propose))
        drafts = dict(zip((rid for rid, _, _ in asks), await self.shards.run(core.speculation.draft, asks)))
        items = tuple(core.proposed(item, drafts.get(item.request_id, ())) for item in group.items)
        return Group(group.shard, group.bucket, items)

    def _presampler(self, group: Group, engine: Engine, into: Presampled) -> Callable[[dict], None] | None:
        """What samples the pass's rows on the engine thread as soon as its logits exist (`into` gets the results):
        the rows the core will ask to sample, with the parameters and sampler states their requests hold now. The
        core still decides (`step_done`); a row it doesn't ask for is dropped (its request ended meanwhile)."""
        asks = []
        for item in group.items:
            req = self.core.requests.get(item.request_id)
            if req is not None and not item.partial:
                asks.append((item.request_id, item.proposals, req.spec.sampling, req.sampler))
        if not asks or self.batcher.closed:
            return None

        def then(outputs: dict) -> None:
            try:
                items = [
                    SampleItem(rid, out if drafts else out[-1], params, state, engine, self.model_id, drafts)
                    for rid, drafts, params, state in asks
                    if isinstance(out := outputs.get(rid), np.ndarray) and out.ndim == 2 and len(out)
                ]
                into.results, into.counts = self.batcher.sample_now(items)
                into.states = {rid: state for rid, _, _, state in asks}
            except Exception:  # the rows take the batcher's own path, which reports what is wrong
                log.exception("sampling the pass's rows on the engine thread failed")

        return then

    def _retain_limit(self) -> int:
        """Bytes finished requests' retained caches may hold: what the requests' reservations leave of the KV
        budget (RETAIN_WITHOUT_BUDGET without one), so retained caches give way before admission refuses anyone."""
        budget = self.core.limits.kv_budget
        return RETAIN_WITHOUT_BUDGET if budget is None else max(0, budget - self.core.kv_reserved)

    # -- carrying out the core's actions ----------------------------------------------------------------------
    def do(self, actions: list[Action], engine: Engine | None = None, presampled: Presampled | None = None) -> None:
        """`presampled`: the pass's rows sampled on the engine thread (`_presampler`); a Sample action for one of
        them takes its result (same request, same sampler state) instead of going through the batcher."""
        samples: dict[str, asyncio.Future] = {}
        done: dict[str, object] = {}
        for action in actions:
            if isinstance(action, Release):
                self.shards.release(action.request_id, keep=action.keep)
            elif isinstance(action, Send):
                self._outbox(action.address).put(*action.activations)
            elif isinstance(action, Deliver):
                self._outbox(action.address).put(action.message)
            elif isinstance(action, Sample):
                if presampled is not None and presampled.has(action.request_id, action.state):
                    done[action.request_id] = presampled.results[action.request_id]
                    continue
                item = SampleItem(
                    action.request_id, action.logits, action.params, action.state, engine, self.model_id, action.drafts
                )
                try:
                    samples[action.request_id] = self.batcher.submit(item)
                except (ValueError, BatcherClosed) as e:
                    self.do(self.core.fail(action.request_id, f"node {self.core.id}: cannot sample: {e}"))
        if samples:
            if not self.core.queue:
                self.batcher.flush()  # no more forward passes queued here: nothing else can join this batch
            self.spawn(self._sampled(samples))
        if done:
            self.counters["presampled_rows"] += len(done)
            self.do(self.core.sampled(done))  # type: ignore[arg-type]

    async def _sampled(self, futures: dict[str, asyncio.Future]) -> None:
        results = await asyncio.gather(*futures.values(), return_exceptions=True)
        self.do(self.core.sampled(dict(zip(futures, results))))

    def _outbox(self, address: str) -> Outbox:
        """The ordered outbox for `address` (activations and token messages alike, so a last node whose entry is
        also the first node sends it the token and its delivery in one call); gone again once it is empty."""
        box = self._outboxes.get(address)
        if box is None:
            box = self._outboxes[address] = Outbox(
                lambda batch: self._send(address, batch),
                self.spawn,
                lambda: self._outboxes.pop(address, None),
                max_bytes=self.transport.max_message_bytes - MESSAGE_ROOM,
                size=_wire_size,
            )
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
            self.do(self.core.send_failed(address, activations, str(e), isinstance(e, TransportError) and e.retryable))
            for message in messages:
                self.do(self.core.deliver_failed(address, message, str(e)))
            return
        self.do(self.core.refused(address, refused))


class Presampled:
    """A pass's rows sampled on the engine thread: results and sampler states by request, and the batcher's counts
    (empty until the sampling ran)."""

    def __init__(self) -> None:
        self.results: dict[str, object] = {}
        self.states: dict[str, object] = {}
        self.counts: list = []  # the batches, for SamplingBatcher.record

    def has(self, request_id: str, state: object) -> bool:
        return request_id in self.results and self.states.get(request_id) is state


def _wire_size(item: Activation | TokenMessage) -> int:
    """About what an item takes in a message: its tensor's bytes, and room for its spec or its results."""
    return ITEM_ROOM + (item.data.nbytes if isinstance(item, Activation) else 0)


def _positions(spec: RequestSpec) -> int | None:
    """The most positions a request's KV cache will hold, when the spec says (it sizes the cache once)."""
    return spec.positions if spec.prompt_tokens else None
