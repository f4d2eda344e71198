"""The step contract (node/core/step_plan.py): the core's plan carries all a pass needs, the engine thread runs it
and samples its rows, and one `step_done(plan, outputs)` applies what it gave.

The core half is driven with plain values; the runtime half runs a real numpy engine on the llama fixture through
the shard manager's one engine-thread call.
"""

import asyncio
import dataclasses

import pytest

from node.core.actions import Deliver, Release, Sample, Send
from node.core.admission import CoreLimits
from node.core.failures import FailureKind
from node.core.node_core import NodeCore
from node.core.requests import Activation
from node.core.scheduler import SchedulerLimits
from node.core.step_plan import PREFIX_GONE, Row, Sampling, StepOutputs, StepPlan
from node.runtime.sampling_batcher import SampleItem, SamplingBatcher
from node.runtime.shard_manager import ShardManager
from shards.decoding.sampling import SampleResult, SamplerState, SamplingParams
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.config import ModelConfig
from shards.model.shard import Shard
from tests.support.factories import ADDR, CFG, hidden, logits, spec, tokens
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


def test_the_engine_gets_each_rows_reservation_and_prompt_length_with_its_input():
    """What sizes a request's cache reaches the engine: its reservation and, for a prompt coming in chunks, the
    positions the whole prompt fills (the ggml engine takes them at the first chunk: cells.py)."""
    seen = []

    class Recording(NumpyEngine):
        def forward(self, batch, *args, **kw):
            seen.extend((i.request_id, i.max_positions, i.prompt_positions) for i in batch)
            return super().forward(batch, *args, **kw)

    async def go():
        shards = ShardManager(FIXTURES / "llama", CFG, lambda d, s, c: Recording(d, s, ModelConfig.from_dir(d)))
        engine = await shards.get(Shard("llama", 0, 4, 6))
        c = core("a")
        c.accept_prompt(dataclasses.replace(spec("r1"), prompt_tokens=40), tokens(*range(1, 33)))
        (plan,) = c.take_batch()
        await shards.execute(engine, plan, None)
        shards.close()

    asyncio.run(go())
    assert seen == [("r1", 40 + 3, 40)]
