"""Following (node/runtime/engine_step.py, node/core/step_plan.py `Follow`): on a one-node ring the engine thread
runs a row on by itself while its sampled token is its next input, pass after pass, and hands the loop each pass;
the core froze the rule in the plan (stop tokens, tokens left, and under prompt lookup whether drafts would come).

The core half is driven with plain values; the runtime half runs a real numpy engine on the llama fixture through
the shard manager's one engine-thread call.
"""

import asyncio
import dataclasses
import threading

import pytest

from node.core.actions import Deliver, Send
from node.core.admission import CoreLimits
from node.core.node_core import NodeCore
from node.core.requests import Activation
from node.core.scheduler import SchedulerLimits
from node.core.step_plan import Follow, Row, Sampling, StepOutputs, StepPlan, next_pass
from node.runtime.engine_step import Following
from node.runtime.sampling_batcher import SamplingBatcher
from node.runtime.shard_manager import ShardManager
from shards.decoding.grammar import Constraint
from shards.decoding.sampling import SampleResult, SamplerState, SamplingParams
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.config import ModelConfig
from shards.model.shard import Shard
from tests.support.factories import CFG, STOP, hidden, logits, spec, tokens
from tests.support.models import FIXTURES
from tests.unit.test_step_plan import LAST, core, of

ONE = (("a", 0, 6),)


def one_node(**kw):
    a = NodeCore("a", "llama", CFG, CoreLimits(), SchedulerLimits(), **kw)
    return a


def test_a_one_node_rings_sampled_rows_may_be_followed_with_their_stop_tokens_and_tokens_left():
    a = one_node()
    a.accept_prompt(spec("r1", nodes=ONE, entry="a", max_tokens=5), tokens(1, 2))
    ((row,),) = [p.rows for p in a.take_batch()]
    assert row.follow == Follow(frozenset({STOP}), 5)
    b = core("c")  # the last node of a longer ring: its token goes to another node first
    b.accept_activations([Activation("r1", hidden(), spec("r1"))])
    ((row,),) = [p.rows for p in b.take_batch()]
    assert row.sample is not None and row.follow is None


def test_no_row_is_followed_while_the_pass_leaves_work_queued_for_a_later_one():
    """A prompt the pass had no room for waits for the next pass: were the rows followed, the engine thread would
    run them to their end first (8 streams' first tokens came 1.2 s after they were sent instead of 0.2 s)."""
    a = NodeCore("a", "llama", CFG, CoreLimits(), SchedulerLimits(step_tokens=3))
    a.accept_prompt(spec("r1", nodes=ONE, entry="a", max_tokens=5), tokens(1, 2))
    a.accept_prompt(spec("r2", nodes=ONE, entry="a", max_tokens=5), tokens(1, 2, 3))
    (plan,) = a.take_batch()
    assert [(r.request_id, len(r.data)) for r in plan.rows] == [("r1", 2), ("r2", 1)] and a.queue
    assert all(r.follow is None for r in plan.rows)
    ((row,),) = [p.rows for p in a.take_batch()]  # the rest of r2's prompt, and nothing left behind
    assert not a.queue and row.request_id == "r2" and row.follow == Follow(frozenset({STOP}), 5)


def test_a_row_runs_on_while_its_proposer_would_draft_nothing_and_a_grammars_is_not_followed():
    """With prompt lookup on (the default), a token usually finds nothing to look up, and sending each through the
    event loop to learn that cost a one-node stream ~10% of its speed. The row runs on while the core's answer
    (`quiet`, asked with each token, as the first node's next_input would ask) is that no drafts would come: a
    token that repeats the text, a paused draft length counting down, and no room for drafts decide as there."""
    from node.core.speculation import Speculation
    from shards.decoding.speculation import PromptLookup

    speculation = Speculation(PromptLookup(), vocab=CFG.vocab_size)
    a = one_node(speculation=speculation)
    a.accept_prompt(spec("r1", nodes=ONE, entry="a", max_tokens=20), tokens(5, 6, 7, 8))
    ((row,),) = [p.rows for p in a.take_batch()]
    quiet = row.follow.quiet
    assert quiet(9, 20) and quiet(5, 19)  # (8, 9), (9, 5): never seen before
    assert not quiet(6, 18)  # (5, 6) was followed by 7: the lookup drafts [7, 8, 9, ...], so back to the queue
    req = a.requests["r1"]
    a.followed(req, 9)  # as the loop records the passes that ran on
    a.followed(req, 5)
    assert speculation.next_input(req, 6, req.positions_in, 64)[1] == (7, 8)  # the drafts the queue's trip makes
    b = one_node(speculation=Speculation(PromptLookup(), vocab=CFG.vocab_size))
    b.accept_prompt(spec("r2", nodes=ONE, entry="a", max_tokens=20), tokens(5, 6, 7, 8, 9))
    ((row,),) = [p.rows for p in b.take_batch()]
    assert row.follow.quiet(5, 2)  # one token left after 5: no room for a draft
    length = b.speculation.lengths["r2"]
    for _ in range(3):
        length.update(1, 0)  # three misses in a row: paused for 4 of its steps
    assert [row.follow.quiet(t, 20) for t in (5, 6, 7, 8, 9)] == [True, True, True, True, False]
    b.accept_prompt(spec("r4", nodes=ONE, entry="a", max_tokens=20), tokens(5, 6))
    assert all(r.follow is None for p in b.take_batch() for r in p.rows)  # two requests: the core batches them
    deferred = one_node(speculation=Speculation(PromptLookup(), vocab=CFG.vocab_size, deferred=True))
    deferred.accept_prompt(spec("r3", nodes=ONE, entry="a"), tokens(1, 2))
    ((row,),) = [p.rows for p in deferred.take_batch()]
    assert row.follow is None  # a draft model's proposals are computed before each step: not on the engine thread
    g = one_node()
    constrained = dataclasses.replace(
        spec("r2", nodes=ONE, entry="a"),
        sampling=SamplingParams(temperature=0, constraint=Constraint("%llguidance {}\nstart: /[0-9]+/")),
    )
    g.accept_prompt(constrained, tokens(1, 2))
    ((row,),) = [p.rows for p in g.take_batch()]
    assert row.follow is None


def test_the_next_pass_carries_each_followed_rows_token_unless_it_stops_or_has_no_tokens_left():
    ask = Sampling(SamplingParams(temperature=0), SamplerState())
    whole = Shard("llama", 0, 6, 6)
    rows = (
        Row("goes", tokens(1, 2), 10, sample=ask, follow=Follow(frozenset({STOP}), 3)),
        Row("stops", tokens(1), 10, sample=ask, follow=Follow(frozenset({STOP}), 3)),
        Row("last", tokens(1), 10, sample=ask, follow=Follow(frozenset({STOP}), 1)),
        Row("failed", tokens(1), 10, sample=ask, follow=Follow(frozenset({STOP}), 3)),
        Row("plain", tokens(1), 10, sample=ask),
    )
    samples = {
        "goes": SampleResult(7),
        "stops": SampleResult(STOP),
        "last": SampleResult(8),
        "failed": ValueError("x"),
        "plain": SampleResult(9),
    }
    (row,) = next_pass(StepPlan(whole, 64, rows, 123), samples).rows
    assert row.request_id == "goes" and row.data.tolist() == [7] and row.follow.left == 2 and row.sample is ask
    assert next_pass(StepPlan(whole, None, rows[1:]), samples) is None
    with pytest.raises(ValueError, match="whole model's shard only"):
        StepPlan(LAST, None, rows[:1])


def test_once_drafts_would_come_for_one_row_the_whole_pass_goes_back_to_the_core_together():
    """A row sent back alone while the others ran on split a batch over two passes: 2-4 streams under prompt
    lookup lost 10-15%. The run ends for every row instead, and the core schedules them in one step."""
    ask = Sampling(SamplingParams(temperature=0), SamplerState())
    whole = Shard("llama", 0, 6, 6)
    asked = []

    def quiet(answer: bool):
        return lambda token, left: asked.append((token, left)) or answer

    calm = Row("calm", tokens(1), 10, sample=ask, follow=Follow(frozenset({STOP}), 5, quiet(True)))
    drafting = Row("drafting", tokens(1), 10, sample=ask, follow=Follow(frozenset({STOP}), 4, quiet(False)))
    samples = {"calm": SampleResult(7), "drafting": SampleResult(8)}
    assert next_pass(StepPlan(whole, None, (calm, drafting)), samples) is None
    assert asked == [(7, 5), (8, 4)]
    (row,) = next_pass(StepPlan(whole, None, (calm,)), samples).rows
    assert row.follow.left == 4 and row.follow.quiet is calm.follow.quiet  # its answer goes on with it


def test_a_followed_row_is_delivered_and_recorded_as_its_next_input_without_coming_back_through_the_queue():
    a = one_node()
    a.accept_prompt(spec("r1", nodes=ONE, entry="a", max_tokens=5), tokens(1, 2))
    (plan,) = a.take_batch()
    out = StepOutputs({"r1": logits()}, samples={"r1": SampleResult(42)}, followed=frozenset({"r1"}))
    actions = a.step_done(plan, out)
    assert [d.message.results for d in of(Deliver, actions)] == [(SampleResult(42),)] and not of(Send, actions)
    req = a.requests["r1"]
    assert (req.chunk_start, req.positions_in, req.generated) == (2, 3, 1)
    assert not a.queue and not a.should_wait and a.counters["followed_rows"] == 1
    following = next_pass(plan, out.samples)
    actions = a.step_done(following, StepOutputs({"r1": logits()}, samples={"r1": SampleResult(43)}))
    (send,) = of(Send, actions)  # not followed this time: back through the queue, at the cache's end
    assert send.activations[0].data.tolist() == [43] and a.requests["r1"].generated == 2


def test_the_engine_thread_runs_followed_passes_that_give_the_tokens_of_passes_run_one_by_one():
    """Exactness: a request's tokens from a run of followed passes equal those of the same request sampled pass
    by pass (same seeds), and the run ends where the request's tokens do."""

    async def go():
        factory = lambda d, s, c: NumpyEngine(d, s, ModelConfig.from_dir(d))  # noqa: E731
        whole = Shard("llama", 0, 6, 6)
        params = SamplingParams(temperature=0.8, seed=7)

        def plan(state, left=6):
            ask = Sampling(params, state)
            return StepPlan(whole, None, (Row("r", tokens(5, 6, 7), 20, sample=ask, follow=Follow(frozenset(), left)),))

        passes = []
        shards = ShardManager(FIXTURES / "llama", CFG, factory)
        batcher = SamplingBatcher(8, 60_000, executor=shards.executor)
        engine = await shards.get(whole)
        following = Following(passes.append)
        assert await shards.execute(engine, plan(SamplerState.from_seed(7)), batcher, following) is None
        assert len(passes) >= 1  # the first pass was handed over before execute returned
        await shards.run(lambda: None)  # the run's passes are done
        await asyncio.sleep(0)  # and handed to the loop
        got = passes
        assert [d.outputs.followed for d in got] == [frozenset({"r"})] * 5 + [frozenset()]
        tokens_followed = [d.outputs.samples["r"].token for d in got]

        alone = ShardManager(FIXTURES / "llama", CFG, factory)
        engine, state, step = await alone.get(whole), SamplerState.from_seed(7), plan(SamplerState.from_seed(7))
        step = dataclasses.replace(step, rows=(dataclasses.replace(step.rows[0], sample=Sampling(params, state)),))
        one_by_one = []
        for _ in range(6):
            done = await alone.execute(engine, step, batcher)  # no following: one pass
            token = done.outputs.samples["r"].token
            one_by_one.append(token)
            row = Row("r", tokens(token), 20, sample=Sampling(params, state), follow=None)
            step = StepPlan(whole, None, (row,))
        assert tokens_followed == one_by_one
        await batcher.close()
        shards.close()
        alone.close()

    asyncio.run(go())


def test_a_run_asks_a_rows_quiet_once_per_token_in_order_and_hands_the_row_back_where_it_says_no():
    """`quiet` may keep state (a draft length's pause counts down, the proposer's text grows by each token), so the
    engine thread asks it exactly once per sampled token, with the tokens left before it, and a row it answers
    False for goes back to the core's queue (where its proposals are made)."""

    async def go():
        whole = Shard("llama", 0, 6, 6)
        shards = ShardManager(FIXTURES / "llama", CFG, lambda d, s, c: NumpyEngine(d, s, ModelConfig.from_dir(d)))
        batcher = SamplingBatcher(8, 60_000, executor=shards.executor)
        engine = await shards.get(whole)
        asked, passes = [], []

        def quiet(token: int, left: int) -> bool:
            asked.append((token, left))
            return len(asked) < 3

        ask = Sampling(SamplingParams(temperature=0), SamplerState())
        row = Row("r", tokens(5, 6), 60, sample=ask, follow=Follow(frozenset(), 50, quiet))
        await shards.execute(engine, StepPlan(whole, None, (row,)), batcher, Following(passes.append))
        await shards.run(lambda: None)
        await asyncio.sleep(0)
        await batcher.close()
        shards.close()
        return asked, passes

    asked, passes = asyncio.run(go())
    assert [d.outputs.followed for d in passes] == [frozenset({"r"})] * 2 + [frozenset()]
    assert asked == [(d.outputs.samples["r"].token, 50 - i) for i, d in enumerate(passes)]


def test_an_interrupt_ends_a_run_of_followed_passes_after_the_pass_it_is_in():
    async def go():
        whole = Shard("llama", 0, 6, 6)
        gate = threading.Event()  # the second pass waits until the loop has taken the first and interrupted

        class Gated(NumpyEngine):
            calls = 0

            def forward(self, *args, **kw):
                Gated.calls += 1
                if Gated.calls == 2:
                    gate.wait(10)
                return super().forward(*args, **kw)

        shards = ShardManager(FIXTURES / "llama", CFG, lambda d, s, c: Gated(d, s, ModelConfig.from_dir(d)))
        batcher = SamplingBatcher(8, 60_000, executor=shards.executor)
        engine = await shards.get(whole)
        passes = []
        following = Following(lambda done: (passes.append(done), following.interrupt(), gate.set()))
        ask = Sampling(SamplingParams(temperature=0), SamplerState())
        plan = StepPlan(whole, None, (Row("r", tokens(5, 6), 60, sample=ask, follow=Follow(frozenset(), 50)),))
        await shards.execute(engine, plan, batcher, following)
        await shards.run(lambda: None)
        await asyncio.sleep(0.05)
        assert len(passes) <= 2 and not passes[-1].outputs.followed  # stopped, its row back to the core's queue
        await batcher.close()
        shards.close()

    asyncio.run(go())


def test_a_pass_with_no_followed_rows_reaches_on_pass_in_the_callback_that_brings_it_back():
    """A ring's pass (its rows go to the next node, none runs on here) is handed to `on_pass` from the engine
    thread's own loop callback: its sends go out before the task that awaited the pass resumes, and `execute`
    returns None as for a followed run."""

    async def go():
        whole = Shard("llama", 0, 6, 6)
        shards = ShardManager(FIXTURES / "llama", CFG, lambda d, s, c: NumpyEngine(d, s, ModelConfig.from_dir(d)))
        engine = await shards.get(whole)
        seen = []
        following = Following(lambda done: seen.append((done, asyncio.current_task())))
        row = Row("r", tokens(5, 6), 20)  # no sampling, no follow: a pass whose output leaves the node
        assert await shards.execute(engine, StepPlan(whole, None, (row,)), None, following) is None
        ((done, task),) = seen
        assert task is None  # a plain loop callback, not the awaiting task's step
        assert done.outputs.outputs["r"].shape == (1, CFG.vocab_size) and not done.outputs.followed
        shards.close()

    asyncio.run(go())


def test_followed_passes_reach_the_loop_together_within_the_handoff_window_and_in_order():
    """The loop's work for a pass costs a wake-up and cold caches, so the engine thread hands it the passes of a
    window together: with a window longer than the run, every pass after the first reaches `on_pass` in one loop
    callback (nothing else runs between them), in order, each stamped with that hand-off; with none, each pass
    comes on its own. The tokens are the same either way."""

    async def run(handoff_s: float):
        whole = Shard("llama", 0, 6, 6)
        shards = ShardManager(FIXTURES / "llama", CFG, lambda d, s, c: NumpyEngine(d, s, ModelConfig.from_dir(d)))
        batcher = SamplingBatcher(8, 60_000, executor=shards.executor)
        engine = await shards.get(whole)
        seen = []

        def on_pass(done):
            seen.append(done)
            asyncio.get_running_loop().call_soon(seen.append, "tick")  # runs once the current callback returns

        ask = Sampling(SamplingParams(temperature=0), SamplerState())
        row = Row("r", tokens(5, 6), 60, sample=ask, follow=Follow(frozenset(), 8))
        await shards.execute(engine, StepPlan(whole, None, (row,)), batcher, Following(on_pass, handoff_s=handoff_s))
        await shards.run(lambda: None)
        await asyncio.sleep(0.01)
        await batcher.close()
        shards.close()
        return [s for s in seen if s != "tick"], seen

    together, seen = asyncio.run(run(handoff_s=60.0))
    assert len(together) == 8 and seen[0] is together[0]
    # the rest in one callback: nothing of the loop's runs between them (the first's callback may have run in the
    # same round of the loop as theirs, when the engine thread was done before the loop woke: its tick then
    # follows them), with one hand-off stamp; the first alone, with none (the loop awaited it)
    rest = next(i for i, s in enumerate(seen) if s is together[1])
    assert all(a is b for a, b in zip(seen[rest : rest + 7], together[1:], strict=True))
    assert sum(s == "tick" for s in seen if isinstance(s, str)) == 8
    assert together[0].handed is None and len({d.handed for d in together[1:]}) == 1
    assert all(d.handed >= d.ended for d in together[1:])
    alone, _ = asyncio.run(run(handoff_s=0.0))
    assert len({d.handed for d in alone[1:]}) == 7
    assert [d.outputs.samples["r"].token for d in alone] == [d.outputs.samples["r"].token for d in together]


def test_a_following_refuses_negative_limits():
    with pytest.raises(ValueError, match="never negative"):
        Following(lambda done: None, handoff_s=-1)
