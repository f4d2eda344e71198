"""One pass on the engine thread (`run_pass`), and the passes that follow it there without a trip through the
event loop (`Following`).

A one-node ring's decode row knows its next input as soon as it is sampled: its own token (unless the first node
would propose drafts after it: `Follow.quiet`, asked here with each token). Sending that token
through the core's queue costs a hand-off to the event loop and back per token, and the engine waits for it. So a
plan's followed rows (`Row.follow`, which the core sets: node/core/step_plan.py) run on here, pass after pass
(`step_plan.next_pass`), while the loop applies each pass's outputs as they come (`Following.on_pass`, through
`call_soon_threadsafe`: tokens reach the client as before, one pass at a time). The core stays the one that
decides: it knows which rows went on (`StepOutputs.followed`) and records their inputs as if they had come
back (`RequestBook.followed`); the engine thread only applies the rule the core froze in the plan (no stop token,
tokens left). It stops when the loop has anything else for it (`interrupt`: new work, an ended request, shutdown),
after `max_passes`, or when no row goes on; the rows still going then come back through the queue.

On a ring of several nodes a decode row's next input comes from a peer: a plan's relayed rows (`Row.relay`, which
the core sets) make the engine thread wait for it after their pass (`RelayInbox`, node/runtime/relay.py), and run
the next pass on it as soon as the loop hands it over (`step_plan.relayed_pass`), laid out before the wait with
the input still to come (`lay_ahead`). Such a pass reaches the loop at once: its messages are the next node's input.

The followed passes reach the loop together, at most every `handoff_s` (and at once when the run ends): each
hand-off wakes the loop, whose work for a pass then takes a core from ggml's threads mid-pass (they wait for it at
their next barrier) and runs on cold caches. Handed several passes at once, the loop does that once for them, hot
for all but the first; a client sees its tokens at most `handoff_s` later, in the same order, the first token of a
run (its plan came from the loop, which waits for it) at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from node.core.requests import Activation, Refusal, TokenMessage
from node.core.step_plan import PREFIX_GONE, Sampled, StepOutputs, StepPlan, awaited, next_pass, relayed_pass
from node.runtime.relay import RelayInbox
from node.runtime.sample_rows import MalformedBatch, picked_results, wants
from shards.engines.base import Engine, EngineInputError, StepInput, check_input
from shards.engines.picks import Best, Pick, Want
from shards.formats.config import ModelConfig

log = logging.getLogger(__name__)
FOLLOW_PASSES = 64  # passes the engine thread runs on by itself at most before the loop schedules again
HANDOFF_S = 0.025  # longest a followed pass waits on the engine thread for the next ones to reach the loop with it


class StepSampler(Protocol):
    """Samples a pass's rows on the engine thread (node/runtime/sampling_batcher.py)."""

    def sample_step(
        self,
        engine: Engine,
        plan: StepPlan,
        outputs: Mapping[str, np.ndarray | None],
        picked: Mapping[str, tuple[int, ...]],
        drawn: Mapping[str, Best],
    ) -> tuple[dict, list]:
        """Results by request (`picked`: rows whose token the engine picked, `drawn`: rows to draw from the
        candidates the engine took, their outputs None), and the counts its owner records on the event loop."""
        ...


@dataclass(frozen=True)
class Written:
    """One message the engine thread wrote: where, what, its answer (to make on the loop: `answer()`), and when it
    was handed to the socket (perf_counter)."""

    address: str
    activations: tuple[Activation, ...]
    answer: Callable[[], Awaitable[list[Refusal]]]
    at: float
    messages: tuple[TokenMessage, ...] = ()  # a last shard's deliveries, with the tokens

    def __post_init__(self) -> None:
        if not self.activations:
            raise ValueError(f"a message to {self.address} carries at least one activation")


@dataclass(frozen=True)
class Executed:
    """A pass as the engine thread ran it: its plan and what the core applies (`NodeCore.step_done`), the sampling
    batches to count, and when the engine thread started and finished it (perf_counter: the time around it is
    overhead)."""

    plan: StepPlan
    outputs: StepOutputs
    sample_counts: list = field(default_factory=list)
    began: float = 0.0
    ended: float = 0.0
    handed: float | None = None  # when the engine thread handed it to the loop, if later than `ended` (Following)
    waited: float = 0.0  # seconds the engine thread waited for its relayed inputs to come (the ring's, not ours)
    relayed: bool = False  # run on inputs handed straight to the engine thread (node/runtime/relay.py)
    written: tuple[Written, ...] = ()  # its messages the engine thread wrote itself (node/runtime/early_send.py)
    ahead: tuple[bool, bool] = (False, False)  # laid out before its inputs came: its plan; its engine step (`Ahead`)


class EarlyWrite(Protocol):
    """Writes a pass's rows with a `to` from the engine thread as it ends (node/runtime/early_send.py)."""

    def rows(
        self, plan: StepPlan, outputs: Mapping[str, np.ndarray | None], samples: Mapping[str, Sampled]
    ) -> tuple[frozenset[str], tuple[Written, ...]]: ...


def run_pass(
    engine: Engine,
    plan: StepPlan,
    sampler: StepSampler | None,
    ahead: Ahead | None = None,
    early: EarlyWrite | None = None,
) -> Executed:
    """One pass on the engine thread: the plan's inputs checked and computed, then its rows sampled (`ahead`: the
    plan's, laid out before its inputs came, which `Ahead.took`), then its rows to send written (`early`) before
    the pass's records are made: the next node waits for them, nobody for the records."""
    began = time.perf_counter()
    if ahead is not None:
        items, refused = list(ahead.items), {}
    else:
        items, refused = _inputs(engine, plan)
    every_row = frozenset(r.request_id for r in plan.rows if r.every_row)
    picked, drawn = {}, {}
    if ahead is not None and ahead.step is not None:
        outputs = {}
        _results(items, ahead.step(), outputs, picked, drawn)
    else:
        outputs = _outputs(
            engine, items, every_row, (wants(plan, engine.takes_best) if sampler is not None else {}), picked, drawn
        )
    computed = time.perf_counter() - began
    samples, counts = {}, []
    if sampler is not None and plan.sampled_rows:
        try:
            samples, counts = sampler.sample_step(engine, plan, outputs, picked, drawn)
        except Exception:  # the rows take the batcher's own path (a Sample action), which reports what is wrong
            log.exception("sampling the pass's rows on the engine thread failed")
            unsampled = {rid: "sampling its candidates failed on the engine thread" for rid in drawn}
            try:
                samples = picked_results(plan, picked)  # theirs need no sampler
            except MalformedBatch as e:  # an engine's picks that don't fit their rows: those requests fail
                unsampled |= {rid: f"the engine's picks are malformed: {e}" for rid in picked}
            outputs = {rid: out for rid, out in outputs.items() if rid not in unsampled}
            refused = {**refused, **unsampled}
    ended = time.perf_counter()
    sent, written = early.rows(plan, outputs, samples) if early is not None else (frozenset(), ())
    outputs_of = StepOutputs(outputs, refused, samples, computed, sent=sent)
    return Executed(plan, outputs_of, counts, began, ended, written=written)


def _inputs(engine: Engine, plan: StepPlan) -> tuple[list[StepInput], dict[str, str]]:
    """The plan's rows as the engine's inputs, each checked (or refused, and why), the retained caches bounded."""
    items, refused = [], {}
    engine.retained.limit = plan.retain_limit
    engine.retained.shrink(plan.retain_limit)
    for row in plan.rows:
        rid = row.request_id
        if row.reuse is not None and engine.cache_length(rid) == 0:  # its first step here: the retained prefix
            entry_id, count = row.reuse
            if not engine.resume(rid, entry_id, count):
                refused[rid] = (
                    f"{PREFIX_GONE}: {engine.shard} no longer holds the first {count} positions of {entry_id}"
                )
                continue
        item = (
            StepInput(rid, tokens=row.data, max_positions=row.max_positions, prompt_positions=row.prompt_positions)
            if engine.shard.is_first
            else StepInput(rid, hidden=row.data, max_positions=row.max_positions, prompt_positions=row.prompt_positions)
        )
        try:
            if row.start is not None:
                engine.rollback(rid, row.start)
            engine.validate([item])
            items.append(item)
        except EngineInputError as e:
            refused[rid] = str(e)
    return items, refused


def _outputs(
    engine: Engine,
    items: list[StepInput],
    every_row: frozenset[str],
    wanted: Mapping[str, Want],
    picked: dict[str, tuple[int, ...]],
    drawn: dict[str, Best],
) -> dict[str, np.ndarray | None]:
    """One engine call for the step, or on a last shard with inputs to verify, one call returning every row's
    logits for them and the decode rows (a decode row's one row is its last), and one for the prompt chunks, whose
    rows but the last nobody needs (a head over 256 rows is costly). Where a call's rows include `pickable` ones
    (greedy, nothing asked of their logits: shards/engines/picks.py), the engine picks their tokens where it
    computed their logits: those come back as tokens (their outputs None, in `picked`), drawn rows whose candidates
    it took as those (`drawn`), the others as logits."""
    whole = [i for i in items if i.request_id in every_row or i.length == 1] if engine.shard.is_last else []
    if not any(i.request_id in every_row for i in whole):
        whole = []
    rest = [i for i in items if i.request_id not in {w.request_id for w in whole}]
    outputs: dict[str, np.ndarray | None] = {}
    for call, all_logits in ((whole, True), (rest, False)):
        if not call:
            continue
        asked = [wanted.get(i.request_id, False) for i in call]
        if not any(asked):
            _results(call, engine.forward(call, all_logits=all_logits), outputs, picked, drawn)
        else:
            _results(call, engine.pick(call, asked, all_logits), outputs, picked, drawn)
    return outputs


def _results(call: list[StepInput], results: list, outputs: dict, picked: dict, drawn: dict) -> None:
    """An engine call's results by request: outputs (`forward`'s) or picks (`pick`'s: tokens, candidates, logits)."""
    for item, out in zip(call, results):
        if not isinstance(out, Pick):
            outputs[item.request_id] = out
            continue
        outputs[item.request_id] = out.logits
        if out.tokens is not None:
            picked[item.request_id] = out.tokens
        elif out.best is not None:
            drawn[item.request_id] = out.best


@dataclass(frozen=True)
class Ahead:
    """A relayed pass laid out while its rows' inputs are on their way (`lay_ahead`): its plan, whose rows' inputs
    are buffers the inputs are copied into once they came (`took`), those rows as the engine's inputs, checked, and
    where the engine lays the step out ahead (`Engine.ahead`), the call that computes it. Why: laying out a pass
    (the plan, the engine's inputs, its step's graph and inputs) is Python on caches the last pass has just filled
    with weights, and on a ring it lay on every hop's path, between the input's arrival and the pass."""

    plan: StepPlan
    buffers: Mapping[str, np.ndarray]
    items: tuple[StepInput, ...]
    step: Callable[[], list] | None
    config: ModelConfig

    def took(self, inputs: Mapping[str, np.ndarray]) -> bool:
        """Whether this is the pass for `inputs` (each row's came, of its buffer's shape and values the engine
        takes): then they are copied in. False: nothing changed; the caller lays the pass out as usual."""
        if inputs.keys() != self.buffers.keys():
            return False
        first = self.plan.shard.is_first
        for rid, data in inputs.items():
            if data.shape != self.buffers[rid].shape:
                return False
            try:
                check_input(self.config, first, data, f"request {rid!r}")
            except EngineInputError:
                return False
        for rid, data in inputs.items():
            self.buffers[rid][...] = data
        return True


def lay_ahead(engine: Engine, plan: StepPlan, rows: tuple[str, ...], sampler: StepSampler | None) -> Ahead | None:
    """The relayed pass after `plan` for `rows` (`relayed_pass`), laid out before their inputs came; None where a
    row would be refused (the usual way then says why). Changes only what the pass itself would (the retained
    caches bounded to its plan's limit, a cache grown for the step)."""
    cfg, first = engine.config, engine.shard.is_first
    buffers = {rid: np.zeros(1, np.int64) if first else np.zeros((1, cfg.hidden_size), np.float32) for rid in rows}
    nxt = relayed_pass(plan, buffers)
    if nxt is None or len(nxt.rows) != len(rows):
        return None
    items, refused = _inputs(engine, nxt)
    if refused:
        return None
    asked = wants(nxt, engine.takes_best) if sampler is not None else {}
    wanted = [asked.get(i.request_id, False) for i in items]
    call = None if any(r.every_row for r in nxt.rows) else engine.ahead(items, wanted if any(wanted) else None)
    return Ahead(nxt, buffers, tuple(items), call, cfg)


class Following:
    """The engine thread's passes for one pipeline: each plan it is handed, then the passes that follow it (a
    one-node ring's rows run on while their token is their next input; a ring's relayed rows run on as their next
    input comes: `relay`, node/runtime/relay.py). `on_pass` is called on the event loop with every pass of a run,
    the first included, in the order they ran (one queue of loop callbacks: a pass's tokens never overtake the
    previous pass's), from the callback that brings it back (no task resumes first); `interrupt` (on the loop)
    ends the current run after the pass it is in."""

    def __init__(
        self, on_pass: Callable[[Executed], None], max_passes: int = FOLLOW_PASSES, handoff_s: float = HANDOFF_S
    ):
        if max_passes < 0 or handoff_s < 0:
            raise ValueError(f"a run's limits are never negative, got {max_passes} passes and {handoff_s} s")
        self.on_pass, self.max_passes, self.handoff_s = on_pass, max_passes, handoff_s
        self.early: EarlyWrite | None = None  # each pass's messages written as it ends
        self.epoch = 0  # bumped by interrupt; a run goes on only while it is the one it started under
        self._running = -1  # the epoch of the run on the engine thread (-1: none)
        self.relay = RelayInbox(lambda: self._running == self.epoch)

    def interrupt(self) -> None:
        self.epoch += 1
        self.relay.wake()

    async def start(self, executor: Executor, engine: Engine, plan: StepPlan, sampler: StepSampler | None) -> None:
        """Run `plan` and its followers; returns once the first pass was handed to `on_pass` (raises what running
        it raised)."""
        loop = asyncio.get_running_loop()
        first: asyncio.Future[None] = loop.create_future()
        executor.submit(self._run, loop, first, self.epoch, engine, plan, sampler)
        await first

    def _run(
        self,
        loop: asyncio.AbstractEventLoop,
        first: asyncio.Future[None],
        epoch: int,
        engine: Engine,
        plan: StepPlan,
        sampler: StepSampler | None,
    ) -> None:
        """On the engine thread: the first pass (to `first`), then its followers (to `on_pass`)."""
        self._running = epoch
        try:
            done, nxt = self._followed(run_pass(engine, plan, sampler, None, self.early), epoch, 0)
        except BaseException as e:
            loop.call_soon_threadsafe(_settle, first, e)
            return
        loop.call_soon_threadsafe(self._first, first, done)
        held: list[Executed] = []  # passes run since the last hand-off
        handed = time.perf_counter()
        for passes in range(1, self.max_passes + 1):
            waited, relayed = 0.0, False
            ahead = None
            if nxt is None and epoch == self.epoch and (rows := awaited(done.plan, done.outputs.outputs)):
                ahead = self._ahead(engine, done.plan, rows, sampler)
                inputs, waited = self.relay.wait(rows)  # (the pass before went to the loop: its sends go first)
                if ahead is not None and ahead.took(inputs):
                    nxt = ahead.plan
                else:
                    nxt, ahead = relayed_pass(done.plan, inputs), None
                relayed = nxt is not None
            if nxt is None:
                return
            try:
                done, nxt = self._followed(run_pass(engine, nxt, sampler, ahead, self.early), epoch, passes)
            except Exception as e:  # a bug: the rows fail, the node serves the others
                log.exception("a followed pass failed")
                why = f"internal error in a followed pass: {e}"
                done, nxt = Executed(nxt, StepOutputs({}, {r.request_id: why for r in nxt.rows})), None
            if relayed:
                laid = (ahead is not None, ahead is not None and ahead.step is not None)
                done = dataclasses.replace(done, waited=waited, relayed=True, ahead=laid)
            held.append(done)
            if nxt is not None and done.ended - handed < self.handoff_s:
                continue  # the run goes on (a run that ends, at its limit or interrupted, has no next pass)
            handed = time.perf_counter()
            try:
                loop.call_soon_threadsafe(self._handed, [dataclasses.replace(d, handed=handed) for d in held])
            except RuntimeError:  # the loop is closed: the node stopped
                return
            held = []

    def _ahead(
        self, engine: Engine, plan: StepPlan, rows: tuple[str, ...], sampler: StepSampler | None
    ) -> Ahead | None:
        try:
            return lay_ahead(engine, plan, rows, sampler)
        except Exception:  # a bug: the pass is laid out once its inputs came, as without this
            log.exception("laying out a relayed pass ahead failed")
            return None

    def _handed(self, passes: list[Executed]) -> None:
        for done in passes:
            self.on_pass(done)

    def _first(self, first: asyncio.Future[None], done: Executed) -> None:
        try:
            self.on_pass(done)
        finally:
            _settle(first)

    def _followed(self, done: Executed, epoch: int, passes: int) -> tuple[Executed, StepPlan | None]:
        """`done` with the rows whose next pass runs here at once (none once interrupted or at the limit), and that
        pass (next_pass asked once per pass: a row's `quiet` may count)."""
        if epoch != self.epoch or passes >= self.max_passes:
            return done, None
        nxt = next_pass(done.plan, done.outputs.samples)  # (its rows were sampled, so computed: StepOutputs)
        if nxt is None:
            return done, None
        followed = frozenset(r.request_id for r in nxt.rows)
        return dataclasses.replace(done, outputs=dataclasses.replace(done.outputs, followed=followed)), nxt


def _settle(future: asyncio.Future, error: BaseException | None = None) -> None:
    if future.done():
        return  # its waiter was cancelled (the node stopping)
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(None)
