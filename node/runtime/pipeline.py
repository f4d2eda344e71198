"""The pipeline: runs the forward passes the core schedules, and carries out the actions the core answers with
(`Send` and `Deliver` -> an ordered outbox per address, `Sample` -> the sampling batcher, `Release` -> the shard
manager), feeding every outcome back to the core. The core decides; this only does, so all the decisions stay
testable without threads, sockets or engines (node/core/node_core.py).

All work that reaches a node is queued in the core, and the worker runs what the core picks in one forward pass,
so concurrent requests batch at every stage of the pipeline. A pass is schedule -> execute -> update: the core's
frozen plan (`take_batch`, node/core/step_plan.py), one engine-thread call that runs and samples it
(`ShardManager.execute`), one `step_done(plan, outputs)`, given to the core in the loop callback that brings the pass
back, its sends before its counters (`Following`, node/runtime/engine_step.py, through which a one-node ring's rows
also run on on the engine thread while their token is their next input). What a node sends itself is taken at once
(`Local`); what it sends a peer is written at once, in that callback, where the transport can (`Transport.post`: a
data link up, nothing queued for the peer), or else queued in its outbox; a hidden decode row's activation is
written by the engine thread itself as its pass ends, where the core named its peer (node/runtime/early_send.py).
A ring's decode rows get their next input from `offer` straight to the engine thread that waits for it
(node/runtime/relay.py). Tokens for this node's clients that come during a decode pass wait for its end and its
sends (`TokenHold`, node/runtime/token_hold.py): the pass goes first.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Protocol

import numpy as np

from node.core.actions import Action, Deliver, Release, Sample, Send
from node.core.node_core import NodeCore
from node.core.request_book import QUEUED, RELAYED
from node.core.requests import Activation, Refusal, TokenMessage
from node.core.step_plan import StepPlan
from node.runtime.calibration import LayerSpeed
from node.runtime.early_send import EarlySend
from node.runtime.engine_step import Executed, Following
from node.runtime.metrics import NodeMetrics
from node.runtime.outbox import Outbox
from node.runtime.overhead import Overhead, thread_clock
from node.runtime.sampling_batcher import BatcherClosed, SampleItem, SamplingBatcher
from node.runtime.shard_manager import ShardManager
from node.runtime.token_hold import TokenHold
from node.runtime.transport import Transport, TransportError
from shards.engines.base import Engine

log = logging.getLogger(__name__)
LOCAL_WAIT_S = 0.02  # longest the worker holds queued work back for a one-node ring's tokens in flight
MESSAGE_ROOM = 1 << 20  # of a peer's message bound, what a call leaves for framing
WARM_WAIT_S = 0.001  # a relayed pass's wait for its input from which the node warms for the next (`_warm`)
WARM_AT = 0.25  # how far into the wait it expects (the last one's) it warms
ITEM_ROOM = 8 << 10  # per item of a call: its spec (plan, sampling) or its results (top logprobs), generously


class Local(Protocol):
    """This node as its own peer (node/runtime/node.py's loopback)."""

    address: str

    def accept(self, activations: tuple[Activation, ...], messages: tuple[TokenMessage, ...]) -> list[Refusal]: ...


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
        local: Local | None = None,
        speed: LayerSpeed | None = None,
    ):
        """`transport`: where `Send`s and `Deliver`s go; `local`: what takes those addressed to this very node at
        once (a one-node ring's next token and its delivery to the entry: no outbox task, no call); `spawn` runs a
        coroutine as a task the node owns (and cancels on stop)."""
        self.core, self.shards, self.batcher, self.transport = core, shards, batcher, transport
        self.model_id, self.metrics, self.spawn, self.local = model_id, metrics, spawn, local
        self.speed = speed  # this node's measured layer throughput, which the passes' compute times refresh
        self.counters: Counter[str] = Counter()  # forward_us_total, step_us_total
        self.overhead = Overhead(self.counters)
        self.following = Following(self._on_pass)
        if (write := getattr(transport, "write_now", None)) is not None:  # (a transport without data links has none)
            self.following.early = EarlySend(core.config, write, self._max_bytes())
        shards.interrupt = self.following.interrupt
        self.hold = TokenHold()  # the entry's tokens wait for a decode pass in flight (node/runtime/token_hold.py)
        self._wake = asyncio.Event()
        self._outboxes: dict[str, Outbox] = {}
        self._posted = 0  # calls whose answer is awaited
        self.warmers: list[Callable[[], None]] = []  # what runs while the ring leaves this node idle (`_warm`)

    @property
    def sending(self) -> bool:
        """Whether messages are still on their way out (a request's last token leaves after it ended here)."""
        return bool(self._outboxes) or self._posted > 0

    def wake(self) -> None:
        """New work was queued in the core: the engine thread stops running rows on by itself (`Following`), so
        the next pass takes the new work with them."""
        self._wake.set()
        self.following.interrupt()

    def interrupt(self) -> None:
        """A request ended from outside, or the node stops: the engine thread stops running rows on by itself."""
        self.following.interrupt()

    # -- the worker -------------------------------------------------------------------------------------------
    async def work(self) -> None:
        core = self.core
        self.overhead.engine_clock = thread_clock(await self.shards.run(threading.get_ident))
        while True:
            if not core.queue or core.should_wait:
                self.hold.idle()
                self._wake.clear()
                waited, for_input = time.perf_counter(), not core.queue  # else for this node's own tokens
                try:
                    await asyncio.wait_for(self._wake.wait(), LOCAL_WAIT_S if core.queue else None)
                    continue
                except TimeoutError:
                    core.stop_waiting()
                finally:
                    if for_input:
                        self.overhead.idle(time.perf_counter() - waited)
            for plan in core.take_batch():
                try:
                    await self._run(plan)
                except Exception as e:  # a bug: fail this batch's requests, keep serving the others
                    log.exception("pipeline step failed")
                    for row in plan.rows:
                        self.do(core.fail(row.request_id, f"internal error: {e}"))
                finally:  # after the pass's sends started (their tasks were made first): the held tokens
                    self.hold.ended()
                    asyncio.get_running_loop().call_soon(self.hold.release)
            # rows the engine thread could not sample wait in the sampling batch: sample them now, not after the
            # window (the next pass, a micro-batch or a prompt chunk, takes longer than the window anyway)
            self.batcher.flush()

    async def _run(self, plan: StepPlan) -> None:
        """Schedule -> execute -> update: the plan runs on the engine thread, which samples its rows there, and
        what it gave goes back to the core in one `step_done`."""
        core = self.core
        try:
            engine = await self.shards.get(plan.shard)
        except Exception as e:
            for row in plan.rows:
                self.do(core.fail(row.request_id, f"cannot load {plan.shard}: {e}"))
            return
        if asks := core.proposal_asks(plan):  # a draft model's proposals, computed on the engine thread
            drafts = await self.shards.run(core.speculation.draft, asks)
            plan = core.proposed(plan, {rid: d for (rid, _, _), d in zip(asks, drafts)})
        if not (plan := core.still_held(plan)).rows:
            return
        try:
            sampler = None if self.batcher.closed else self.batcher
            if sampler is not None and any(r.sample and r.sample.params.constraint for r in plan.sampled_rows):
                sampler.expect_grammar()
            self.overhead.submitted()
            self.hold.started(plan)
            await self.shards.execute(engine, plan, sampler, self.following)  # each pass to _on_pass
        except Exception as e:
            log.exception("forward failed")
            for row in plan.rows:
                self.do(core.fail(row.request_id, f"forward failed: {e}"))

    def _on_pass(self, done: Executed) -> None:
        """A pass the engine thread ran (the plan `_run` handed it, then any that followed: `Following`), on the
        loop, in order, in the callback that brings it back."""
        try:
            self._applied(done, self.shards.engines.get(done.plan.shard))
        except Exception as e:  # a bug: fail the pass's requests, keep serving the others
            log.exception("applying a pass failed")
            for row in done.plan.rows:
                self.do(self.core.fail(row.request_id, f"internal error: {e}"))
        if done.relayed:  # the pass the relayed inputs came for ran, and its sends left: the held tokens go
            self.hold.ran()
            asyncio.get_running_loop().call_soon(self.hold.release)
            self._warm(done)

    def _warm(self, done: Executed) -> None:
        """After a relayed pass whose input this node waited for (at least WARM_WAIT_S: the ring's other nodes
        computing), with nothing queued, the engine thread waits for the ring again, about as long: a quarter of the
        way in (WARM_AT: after this pass's own work on the loop, well before the input), the warmers run the taking
        of the next input on the last one (node/grpc/link/server.py `warm`), if it still waits for it. Never
        raises: a warmer's failure is logged and changes nothing."""
        if self.warmers and done.waited >= WARM_WAIT_S and not self.core.queue:
            asyncio.get_running_loop().call_later(done.waited * WARM_AT, self._warmers)

    def _warmers(self) -> None:
        if not self.following.relay.waiting:  # its input came, or other work did
            return
        for warm in self.warmers:
            try:
                warm()
            except Exception:
                log.exception("warming the next input's taking failed")

    def offer(self, activations: list[Activation], caller: str | None, received: float | None = None) -> list[Refusal]:
        """A peer's activations: the core takes them, handing those the engine thread waits for (a relayed row's
        next input: node/runtime/relay.py) straight to it and queueing the others, for which the worker wakes."""
        queued, taken = len(self.core.queue), []

        def take(waited: frozenset[str]) -> tuple[list[Refusal], dict[str, np.ndarray]]:
            got = self.core.relay_activations(activations, caller, waited)
            taken.append(time.perf_counter())  # (the offer then yields the core to the engine thread it woke)
            return got

        rejected, relayed = self.following.relay.offer(take)
        self.overhead.arrived(taken[0] if taken else None, received)
        if len(rejected) < len(activations) and all(len(a.data) == 1 for a in activations):
            self.hold.arrived()  # tokens in the same message go to the client after the pass
        if len(self.core.queue) != queued or not relayed:
            self.wake()
        return rejected

    def relay_row(self, request_id: str, data: np.ndarray, caller: str | None, received: float | None) -> bool:
        """A decode row's input from a peer, taken the short way where the engine thread waits for it and the core
        takes it there (`RequestBook.relay_row`): handed straight to the engine thread, or queued with the first
        node's proposals. False where not: nothing changed, the message takes `offer`'s way."""
        taken: list[tuple[str | None, float]] = []  # the core's verdict, and when

        def take() -> bool:
            verdict = self.core.relay_row(request_id, data, caller)
            taken.append((verdict, time.perf_counter()))
            return verdict == RELAYED

        self.following.relay.hand(request_id, data, take)
        if not taken or taken[0][0] is None:  # nobody waits for it, or the core left it: nothing changed
            return False
        verdict, at = taken[0]
        self.overhead.arrived(at, received)
        self.hold.arrived()
        if verdict == QUEUED:
            self.wake()
        return True

    def _applied(self, done: Executed, engine: Engine | None) -> None:
        """Give what a pass made to the core, then count it: its sends leave first (the next node waits for them,
        nobody for the counters). forward_us: the engine computing; step_us: the pass on the engine thread, its
        inputs checked and rows sampled; the time between passes is overhead."""
        core, plan = self.core, done.plan
        self.overhead.applied(done.ended if done.handed is None else done.handed)
        self.overhead.idle(done.waited)
        alone = core.active <= 1  # before step_done, which may end the pass's requests
        self.do(core.step_done(plan, done.outputs), engine)
        for w in done.written:  # what the engine thread wrote as the pass ended: their answers, as `_post`'s
            self._posted += 1
            self.spawn(self._answered(w.address, w.activations, w.messages, w.answer(), w.at, [w.at]))
        seconds = done.ended - done.began
        self.counters["forward_us_total"] += int(done.outputs.computed * 1e6)
        self.counters["step_us_total"] += int(seconds * 1e6)
        self.counters["ahead_passes"] += done.ahead[0]  # relayed passes laid out before their inputs came
        self.counters["ahead_steps"] += done.ahead[1]  # the engine's step too (`Engine.ahead`)
        self.overhead.ran(done.began, done.ended)
        self.overhead.read_cpu()
        if self.speed is not None:
            self.speed.observed(plan.shard, plan.positions, done.outputs.computed, alone=alone)
        self.metrics.step_done(seconds, len(plan.rows), plan.positions)
        self.batcher.record(done.sample_counts)
        if prefills := core.draft_prefills(plan):  # a draft model reads the prompts while the ring computes
            self.spawn(self.shards.run(core.speculation.prefill, prefills))

    # -- carrying out the core's actions ----------------------------------------------------------------------
    def do(self, actions: list[Action], engine: Engine | None = None) -> None:
        """`engine`: the one whose pass the actions follow (a `Sample` action's row is sampled with it)."""
        samples: dict[str, asyncio.Future] = {}
        out: dict[str, list[Activation | TokenMessage]] = {}  # by address, in order: one message each where it can
        for action in actions:
            if isinstance(action, Release):
                self.shards.release(action.request_id, keep=action.keep, branch=action.branch)
                self.following.interrupt()  # however it ended, no more passes for it on the engine thread
            elif isinstance(action, Send):
                if self._here(action.address):
                    self.do(self.core.refused(action.address, self.local.accept(action.activations, ())))
                else:
                    out.setdefault(action.address, []).extend(action.activations)
            elif isinstance(action, Deliver):
                if self._here(action.address):
                    self.local.accept((), (action.message,))
                else:
                    out.setdefault(action.address, []).append(action.message)
            elif isinstance(action, Sample):
                self.following.interrupt()  # the batcher samples it on the engine thread: no run may hold that up
                item = SampleItem(
                    action.request_id, action.logits, action.params, action.state, engine, self.model_id, action.drafts
                )
                try:
                    samples[action.request_id] = self.batcher.submit(item)
                except (ValueError, BatcherClosed) as e:
                    self.do(self.core.fail(action.request_id, f"cannot sample: {e}"))
        for address, items in out.items():  # written at once where they can be (the next node waits for them)
            if not self._post(address, items):
                self._outbox(address).put(*items)
        if samples:
            if not self.core.queue:
                self.batcher.flush()  # no more forward passes queued here: nothing else can join this batch
            self.spawn(self._sampled(samples))

    def _max_bytes(self) -> int:
        return self.transport.max_message_bytes - MESSAGE_ROOM

    def _here(self, address: str) -> bool:
        return self.local is not None and address == self.local.address

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
                max_bytes=self._max_bytes(),
                size=_wire_size,
            )
        return box

    def _post(self, address: str, items: list[Activation | TokenMessage]) -> bool:
        """`items` for `address` in one message written now, where nothing is queued for it and the transport can
        write without waiting (its data link: `Transport.post`); False: they go through the outbox."""
        post = getattr(self.transport, "post", None)  # (a transport without data links has none)
        if post is None or address in self._outboxes or sum(map(_wire_size, items)) > self._max_bytes():
            return False
        activations = tuple(m for m in items if isinstance(m, Activation))
        messages = tuple(m for m in items if isinstance(m, TokenMessage))
        handed: list[float] = []
        called = time.perf_counter()
        try:
            answer = post(address, activations, messages, on_write=lambda: handed.append(time.perf_counter()))
        except Exception:  # (one that can't be encoded: the outbox's call fails its requests, saying why)
            return False
        if answer is None:
            return False
        self._posted += 1
        self.spawn(self._answered(address, activations, messages, answer, called, handed))
        return True

    async def _send(self, address: str, batch: tuple[Activation | TokenMessage, ...]) -> None:
        activations = tuple(m for m in batch if isinstance(m, Activation))
        messages = tuple(m for m in batch if isinstance(m, TokenMessage))
        handed: list[float] = []
        called = time.perf_counter()
        call = self.transport.send(address, activations, messages, on_write=lambda: handed.append(time.perf_counter()))
        self._posted += 1
        await self._answered(address, activations, messages, call, called, handed)

    async def _answered(
        self,
        address: str,
        activations: tuple[Activation, ...],
        messages: tuple[TokenMessage, ...],
        answer: Awaitable[list[Refusal]],
        called: float,
        handed: list[float],
    ) -> None:
        """A call's answer: its refusals to the core, or its failure, which fails its requests (never vanish)."""
        try:
            refused = await answer
            if activations:
                self.overhead.sent(called, time.perf_counter(), handed[0] if handed else None)
        except Exception as e:  # a transport error, or a message that can't be sent
            if not isinstance(e, TransportError):
                log.exception("sending to %s failed", address)
            self.metrics.rpc_error(address, "send")
            self.do(self.core.send_failed(address, activations, str(e), isinstance(e, TransportError) and e.retryable))
            for message in messages:
                self.do(self.core.deliver_failed(address, message, str(e)))
            return
        finally:
            self._posted -= 1
        self.do(self.core.refused(address, refused))


def _wire_size(item: Activation | TokenMessage) -> int:
    """About what an item takes in a message: its tensor's bytes, and room for its spec or its results."""
    return ITEM_ROOM + (item.data.nbytes if isinstance(item, Activation) else 0)
