"""The step contract (node/core/step_plan.py): the core's plan carries all a pass needs, the engine thread runs it
and samples its rows, and one `step_done(plan, outputs)` applies what it gave.

The core half is driven with plain values; the runtime half runs a real numpy engine on the llama fixture through
the shard manager's one engine-thread call.
"""

import asyncio
import dataclasses
import threading

import pytest

from node.core.actions import Deliver, Release, Sample, Send
from node.core.admission import CoreLimits
from node.core.failures import FailureKind
from node.core.node_core import NodeCore
from node.core.requests import Activation
from node.core.scheduler import SchedulerLimits
from node.core.step_plan import PREFIX_GONE, Follow, Row, Sampling, StepOutputs, StepPlan, next_pass
from node.runtime.engine_step import Following
from node.runtime.sampling_batcher import SampleItem, SamplingBatcher
from node.runtime.shard_manager import ShardManager
from shards.decoding.grammar import Constraint
from shards.decoding.sampling import SampleResult, SamplerState, SamplingParams
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.config import ModelConfig
from shards.model.shard import Shard
from tests.support.factories import ADDR, CFG, STOP, hidden, logits, spec, tokens
from tests.support.models import FIXTURES

LAST = Shard("llama", 4, 6, 6)


def core(node_id, **limits):
    return NodeCore(node_id, "llama", CFG, CoreLimits(**limits), SchedulerLimits(micro_batches=1))


def sized(rid="r1", prompt=4, max_tokens=3, **kw):
    return dataclasses.replace(spec(rid, max_tokens=max_tokens), prompt_tokens=prompt, **kw)


def of(kind, actions):
    return [a for a in actions if isinstance(a, kind)]


# -- schedule: the plan carries everything --------------------------------------------------------------------
def test_a_last_nodes_plan_carries_each_rows_input_positions_and_its_requests_sampling():
    c = core("c", kv_budget=1 << 30)
    c.accept_activations([Activation("r1", hidden(4), sized("r1")), Activation("r2", hidden(2), sized("r2", 2))])
    (plan,) = c.take_batch()
    assert plan.shard == LAST and [r.request_id for r in plan.rows] == ["r1", "r2"]
    r1 = plan.rows[0]
    assert r1.data.shape == (4, CFG.hidden_size) and r1.max_positions == 4 + 3 and r1.start is None
    assert r1.sample == Sampling(c.requests["r1"].spec.sampling, c.requests["r1"].sampler)
    assert r1.sample.state is c.requests["r1"].sampler  # the request's own stream: sampling advances it
    assert plan.retain_limit == (1 << 30) - c.kv_reserved  # what the reservations leave retained caches


def test_a_prompt_chunk_with_more_to_come_is_planned_without_sampling_and_a_middle_node_samples_nothing():
    c = core("c")
    c.accept_activations([Activation("r1", hidden(3), sized("r1", 5), partial=True)])
    ((chunk,),) = [p.rows for p in c.take_batch()]
    assert chunk.partial and chunk.sample is None
    assert chunk.prompt_positions == 5  # the whole prompt's: an engine may size the cache once for it
    b = core("b")
    b.accept_activations([Activation("r1", hidden(), spec())])
    (plan,) = b.take_batch()
    assert plan.sampled_rows == ()


def test_a_plan_names_the_prefix_a_request_starts_from():
    b = core("b")
    b.accept_activations([Activation("r1", hidden(2), sized("r1", 6, reuse_from="old", reuse_positions=4))])
    ((row,),) = [p.rows for p in b.take_batch()]
    assert row.reuse == ("old", 4)


def test_a_plan_is_frozen_when_taken_whatever_the_core_does_while_it_runs():
    c = core("c")
    c.accept_activations([Activation("r1", hidden(), spec("r1")), Activation("r2", hidden(), spec("r2"))])
    (plan,) = c.take_batch()
    c.end_request("r2", "cancelled")
    c.accept_activations([Activation("r3", hidden(), spec("r3"))])
    assert [r.request_id for r in plan.rows] == ["r1", "r2"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.rows = ()  # type: ignore[misc]


def test_a_plan_refuses_two_inputs_of_one_request_and_sampling_off_the_last_shard():
    with pytest.raises(ValueError, match="one input per request"):
        StepPlan(LAST, None, (Row("r1", hidden()), Row("r1", hidden())))
    ask = Sampling(SamplingParams(temperature=0), SamplerState())
    with pytest.raises(ValueError, match="last shard only"):
        StepPlan(Shard("llama", 2, 4, 6), None, (Row("r1", hidden(), sample=ask),))
    with pytest.raises(ValueError, match="nothing to sample"):
        Row("r1", hidden(), partial=True, sample=ask)
    with pytest.raises(ValueError, match="sampled without outputs"):
        StepOutputs({}, samples={"r1": SampleResult(1)})
    with pytest.raises(ValueError, match="both refused and computed"):
        StepOutputs({"r1": logits()}, {"r1": "bad"})


# -- update: one step_done applies outputs and samples ---------------------------------------------------------
def test_rows_sampled_with_the_pass_are_delivered_and_sent_back_in_the_same_step_done():
    c = core("c")
    c.accept_activations([Activation("r1", hidden(), spec("r1")), Activation("r2", hidden(), spec("r2"))])
    (plan,) = c.take_batch()
    done = StepOutputs({"r1": logits(), "r2": logits()}, samples={"r1": SampleResult(42), "r2": SampleResult(43)})
    actions = c.step_done(plan, done)
    assert not of(Sample, actions)
    assert [d.message.results[0].token for d in of(Deliver, actions)] == [42, 43]
    (send,) = of(Send, actions)
    assert send.address == ADDR["a"] and [a.data.tolist() for a in send.activations] == [[42], [43]]
    assert c.counters["presampled_rows"] == 2 and c.requests["r1"].generated == 1


def test_a_row_the_engine_thread_could_not_sample_is_asked_for_with_a_sample_action():
    c = core("c")
    c.accept_activations([Activation("r1", hidden(), spec("r1")), Activation("r2", hidden(), spec("r2"))])
    (plan,) = c.take_batch()
    actions = c.step_done(plan, StepOutputs({"r1": logits(), "r2": logits()}, samples={"r1": SampleResult(42)}))
    (sample,) = of(Sample, actions)
    assert sample.request_id == "r2" and sample.state is plan.rows[1].sample.state
    assert [d.message.request_id for d in of(Deliver, actions)] == ["r1"]


def test_a_row_whose_request_ended_during_the_pass_is_released_and_its_sample_dropped():
    c = core("c")
    c.accept_activations([Activation("r1", hidden(), spec("r1")), Activation("r2", hidden(), spec("r2"))])
    (plan,) = c.take_batch()
    c.end_request("r2", "cancelled")
    samples = {"r1": SampleResult(42), "r2": SampleResult(43)}
    actions = c.step_done(plan, StepOutputs({"r1": logits(), "r2": logits()}, samples=samples))
    assert Release("r2") in actions and [d.message.request_id for d in of(Deliver, actions)] == ["r1"]
    assert all(a.request_id == "r1" for s in of(Send, actions) for a in s.activations)


def test_a_sampling_error_in_the_pass_fails_only_its_request():
    c = core("c")
    c.accept_activations([Activation("r1", hidden(), spec("r1")), Activation("r2", hidden(), spec("r2"))])
    (plan,) = c.take_batch()
    samples = {"r1": ValueError("grammar rejects"), "r2": SampleResult(7)}
    actions = c.step_done(plan, StepOutputs({"r1": logits(), "r2": logits()}, samples=samples))
    by_request = {d.message.request_id: d.message for d in of(Deliver, actions)}
    assert by_request["r1"].finish_reason == "error" and "grammar rejects" in by_request["r1"].error
    assert by_request["r2"].results == (SampleResult(7),) and list(c.requests) == ["r2"]


def test_an_evicted_prefix_fails_its_request_as_prefix_gone_and_other_refusals_as_errors():
    b = core("b")
    b.accept_activations([Activation("r1", hidden(), spec("r1")), Activation("r2", hidden(), spec("r2"))])
    (plan,) = b.take_batch()
    actions = b.step_done(plan, StepOutputs({}, {"r1": f"{PREFIX_GONE}: no longer held", "r2": "too long"}))
    told = {d.message.request_id: d.message.failure for d in of(Deliver, actions)}
    assert told["r1"].kind == FailureKind.PREFIX_GONE and str(told["r1"]) == f"node b: {PREFIX_GONE}: no longer held"
    assert told["r2"].kind == FailureKind.ERROR and str(told["r2"]) == "node b: too long"
    assert b.counters["prefix_gone"] == 1 and not b.requests


def test_the_pass_teaches_the_scheduler_its_cost():
    b = core("b")
    b.accept_activations([Activation("r1", hidden(), spec("r1"))])
    (plan,) = b.take_batch()
    b.step_done(plan, StepOutputs({"r1": hidden()}, computed=0.03))
    assert b.queue.costs.decode_s == pytest.approx(0.03)


# -- execute: one engine-thread call runs the plan and samples it ----------------------------------------------
def test_the_engine_thread_runs_a_plan_and_samples_its_rows_as_the_batcher_would():
    """The shard manager's one call: the pass, then its rows sampled there, with the plan's states. Same tokens
    and logprobs as sampling the same logits through submit and flush; a refused input is neither run nor
    sampled."""

    async def go():
        shards = ShardManager(FIXTURES / "llama", CFG, lambda d, s, c: NumpyEngine(d, s, ModelConfig.from_dir(d)))
        batcher, reference = SamplingBatcher(8, 60_000, executor=shards.executor), SamplingBatcher(8, 60_000)
        engine = await shards.get(Shard("llama", 0, 6, 6))
        params = [SamplingParams(temperature=0.8, seed=s, top_logprobs=2) for s in (1, 2)]
        states = [SamplerState.from_seed(1), SamplerState.from_seed(2)]
        rows = tuple(
            Row(f"r{i}", tokens(5 + i, 6, 7), 10, sample=Sampling(p, st))
            for i, (p, st) in enumerate(zip(params, states))
        )
        bad = Row("bad", tokens(CFG.vocab_size + 1), 10, sample=Sampling(params[0], SamplerState.from_seed(1)))
        ran = await shards.execute(engine, StepPlan(engine.shard, None, (*rows, bad)), batcher)
        done = ran.outputs
        assert sorted(done.outputs) == sorted(done.samples) == ["r0", "r1"] and "bad" in done.refused
        assert ran.began <= ran.ended and done.computed > 0
        fresh = [SamplerState.from_seed(1), SamplerState.from_seed(2)]
        items = [
            SampleItem(f"r{i}", done.outputs[f"r{i}"][-1], p, st, engine, "llama")
            for i, (p, st) in enumerate(zip(params, fresh))
        ]
        futures = [reference.submit(i) for i in items]
        reference.flush()
        assert [done.samples[f"r{i}"] for i in range(2)] == await asyncio.gather(*futures)
        batcher.record(ran.sample_counts)
        assert batcher.stats["sample_items"] == 2 and batcher.stats["sample_calls"] == 1
        await reference.close()
        await batcher.close()
        shards.close()

    asyncio.run(go())


def test_rows_whose_request_ended_before_the_pass_started_are_left_out_of_it():
    c = core("c")
    c.accept_activations([Activation("r1", hidden(), spec("r1")), Activation("r2", hidden(), spec("r2"))])
    (plan,) = c.take_batch()
    assert c.still_held(plan) is plan
    c.end_request("r1", "cancelled")  # while the pass waited for its engine to load
    assert [r.request_id for r in c.still_held(plan).rows] == ["r2"]


# -- following: the engine thread runs a one-node ring's rows on by itself --------------------------------------
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


def test_rows_a_proposer_drafts_for_or_a_grammar_constrains_are_not_followed():
    from node.core.speculation import Speculation
    from shards.decoding.speculation import PromptLookup

    a = one_node(speculation=Speculation(PromptLookup(), vocab=CFG.vocab_size))
    a.accept_prompt(spec("r1", nodes=ONE, entry="a"), tokens(1, 2))
    ((row,),) = [p.rows for p in a.take_batch()]
    assert row.follow is None  # its next input is the proposer's to make
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
