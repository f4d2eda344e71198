"""The node core, driven with plain values: admission, batch selection, routing, ending and failing.

No engine, no network, no event loop: each test feeds the core what would have arrived and checks the actions it
answers with.
"""

import dataclasses

import numpy as np
import pytest

from node.core.actions import Deliver, Release, Sample, Send
from node.core.admission import CoreLimits
from node.core.failures import Failure, FailureKind
from node.core.node_core import NodeCore
from node.core.plan import PlanError, PlanStep, RequestSpec
from node.core.requests import Activation, Refusal, TokenMessage, Tombstones
from node.core.scheduler import SchedulerLimits
from node.core.step_plan import Row, StepOutputs, StepPlan
from shards.decoding.sampling import SampleResult
from shards.model.shard import Shard
from tests.support.factories import ADDR, CFG, STOP, hidden, logits, spec, tokens

# these tests batch a ring's rows together (micro-batches: test_microbatches)
ONE_BATCH = SchedulerLimits(micro_batches=1)


def core(node_id, scheduling=ONE_BATCH, **limits):
    return NodeCore(node_id, "llama", CFG, CoreLimits(**limits), scheduling)


def ran(shard, **outputs):
    """A plan over requests' single-position inputs, as a pass the core handed out earlier would have been."""
    return StepPlan(shard, None, tuple(Row(rid, np.zeros(1)) for rid in outputs))


def of(kind, actions):
    return [a for a in actions if isinstance(a, kind)]


def sized(rid, prompt_tokens, max_tokens):
    return dataclasses.replace(spec(rid, max_tokens=max_tokens), prompt_tokens=prompt_tokens)


# -- admission ------------------------------------------------------------------------------------------------
def test_the_first_node_takes_a_prompt_and_queues_it():
    a = core("a")
    a.accept_prompt(spec(), tokens(1, 2, 3))
    assert list(a.requests) == ["r1"] and [q.request_id for q in a.queue.queue] == ["r1"]


@pytest.mark.parametrize(
    "bad,message",
    [
        (tokens(), "non-empty"),
        (np.array([1.0, 2.0]), "int token array"),
        (tokens(1, 512), "out of range"),
        (tokens(-1), "out of range"),
        (np.array([2**63], np.uint64), "out of range"),
        (tokens(*range(70), 512), "out of range"),  # (a long input's bounds come from numpy, a short one's not)
        (tokens(*range(70), -1), "out of range"),
    ],
)
def test_a_malformed_prompt_is_refused_before_any_state_is_kept(bad, message):
    a = core("a")
    with pytest.raises(PlanError, match=message):
        a.accept_prompt(spec(), bad)
    assert not a.requests and not a.queue


def test_a_prompt_for_another_first_node_or_a_known_request_is_refused():
    b = core("b")
    with pytest.raises(PlanError, match="first node is a"):
        b.accept_prompt(spec(), tokens(1))
    a = core("a")
    a.accept_prompt(spec(), tokens(1))
    with pytest.raises(PlanError, match="already exists"):
        a.accept_prompt(spec(), tokens(1))
    a.end_request("r1", "cancelled")
    with pytest.raises(PlanError, match="already exists"):  # an ended id never comes back to life
        a.accept_prompt(spec(), tokens(1))


def test_activations_admit_with_their_spec_and_refuse_strays_per_entry():
    b = core("b")
    rejected = b.accept_activations([Activation("r1", hidden(3), spec()), Activation("stray", hidden())])
    assert [r.request_id for r in rejected] == ["stray"] and "unknown request" in rejected[0].reason
    assert list(b.requests) == ["r1"] and b.requests["r1"].step_index == 1


def test_activations_of_the_wrong_shape_or_for_other_nodes_are_refused():
    b = core("b")
    rejected = b.accept_activations(
        [
            Activation("r1", np.zeros((1, 7), np.float32), spec("r1")),
            Activation("r2", hidden(), spec("r2", nodes=(("a", 0, 3), ("c", 3, 6)))),
        ]
    )
    assert "hidden states" in rejected[0].reason and "not in the plan" in rejected[1].reason


def test_late_activations_of_an_ended_request_are_dropped_silently():
    b = core("b")
    b.accept_activations([Activation("r1", hidden(), spec())])
    assert b.end_request("r1", "cancelled") == [Release("r1", keep=True)]  # valid caches: kept for prefix reuse
    assert b.accept_activations([Activation("r1", hidden(), spec())]) == []
    assert not b.requests and b.counters["ended_cancelled"] == 1


def test_a_node_at_its_request_limit_refuses_more():
    b = core("b", max_requests=2)
    rejected = b.accept_activations([Activation(f"r{i}", hidden(), spec(f"r{i}")) for i in range(3)])
    assert [(r.request_id, r.failure.kind) for r in rejected] == [
        ("r2", FailureKind.BUSY)
    ] and "limit of 2" in rejected[0].reason


def test_a_plan_for_another_model_is_refused():
    b = core("b")
    other = spec()
    other = RequestSpec(
        "r1",
        tuple(
            PlanStep(s.node_id, s.address, Shard("other", s.shard.start_layer, s.shard.end_layer, 6))
            for s in other.plan
        ),
        other.sampling,
        3,
        other.stop_token_ids,
        "entry",
        ADDR["entry"],
    )
    (rejected,) = b.accept_activations([Activation("r1", hidden(), other)])
    assert "this node serves llama" in rejected.reason and rejected.failure.kind is FailureKind.REFUSED


# -- choosing a forward pass ----------------------------------------------------------------------------------
def ids(groups):
    return [r.request_id for g in groups for r in g.rows]


def test_a_batch_takes_one_input_per_request_in_arrival_order():
    b = core("b")
    b.accept_activations([Activation("r1", hidden(), spec("r1")), Activation("r2", hidden(), spec("r2"))])
    b.accept_activations([Activation("r1", hidden())])  # r1's next input must wait for the next pass
    (group,) = b.take_batch()
    assert group.shard == Shard("llama", 2, 4, 6) and ids([group]) == ["r1", "r2"]
    assert [i.request_id for i in b.queue.queue] == ["r1"]


def test_a_batch_skips_ended_requests_and_groups_by_shard():
    b = core("b")
    b.accept_activations(
        [
            Activation("r1", hidden(), spec("r1")),
            Activation("r2", hidden(), spec("r2", nodes=(("a", 0, 1), ("b", 1, 6)))),
            Activation("r3", hidden(), spec("r3")),
        ]
    )
    b.end_request("r3", "cancelled")
    assert {g.shard: ids([g]) for g in b.take_batch()} == {
        Shard("llama", 2, 4, 6): ["r1"],
        Shard("llama", 1, 6, 6): ["r2"],
    }


def test_a_long_prompt_is_prefilled_in_chunks_marked_partial_until_the_last():
    a = core("a", SchedulerLimits(step_tokens=64, prefill_chunk=32, micro_batches=1))
    a.accept_prompt(sized("r1", 70, 3), tokens(*range(70)))
    chunks = []
    while a.queue:
        (group,) = a.take_batch()
        (item,) = group.rows
        chunks.append((len(item.data), item.partial))
        (send,) = a.step_done(group, StepOutputs({"r1": hidden(len(item.data))}))
        assert send.activations[0].partial == item.partial
    assert chunks == [(32, True), (32, True), (6, False)]


def test_the_last_node_samples_only_after_the_prompts_last_chunk_and_tells_the_entry_of_each_before():
    c = core("c")
    c.accept_activations([Activation("r1", hidden(32), sized("r1", 38, 3), partial=True)])
    (group,) = c.take_batch()
    assert c.step_done(group, StepOutputs({"r1": logits()})) == [Deliver(ADDR["entry"], TokenMessage("r1"))]
    c.accept_activations([Activation("r1", hidden(6))])
    (group,) = c.take_batch()
    assert [type(a) for a in c.step_done(group, StepOutputs({"r1": logits()}))] == [Sample]


# -- routing outputs ------------------------------------------------------------------------------------------
def test_hidden_states_go_to_the_next_node_with_the_spec_only_the_first_time():
    b = core("b")
    b.accept_activations([Activation("r1", hidden(4), sized("r1", 4, 3))])
    (group,) = b.take_batch()
    (send,) = b.step_done(group, StepOutputs({"r1": hidden(4)}))
    assert send.address == ADDR["c"] and send.activations[0].spec == sized("r1", 4, 3)
    b.accept_activations([Activation("r1", hidden())])
    (send,) = b.step_done(b.take_batch()[0], StepOutputs({"r1": hidden()}))
    assert send.activations[0].spec is None
    assert (b.counters["steps"], b.counters["step_rows"]) == (2, 2)


def test_the_last_node_samples_delivers_and_sends_the_token_back_to_the_first():
    c = core("c")
    c.accept_activations([Activation("r1", hidden(), spec())])
    logits = np.arange(10, dtype=np.float32)[None]
    logits = np.arange(CFG.vocab_size, dtype=np.float32)[None]
    (sample,) = c.step_done(c.take_batch()[0], StepOutputs({"r1": logits}))
    assert isinstance(sample, Sample) and np.array_equal(sample.logits, logits[-1])
    deliver, send = c.sampled({"r1": SampleResult(42)})
    assert deliver == Deliver(ADDR["entry"], TokenMessage("r1", (SampleResult(42),), False, None))
    assert send.address == ADDR["a"] and send.activations[0].data.tolist() == [42]
    assert send.activations[0].spec is None  # the first node has the spec already


@pytest.mark.parametrize(
    "results,reason",
    [
        ([SampleResult(STOP)], "stop"),
        ([SampleResult(1), SampleResult(2), SampleResult(3)], "length"),  # max_tokens 3
    ],
)
def test_a_stop_token_or_max_tokens_finishes_the_request_on_the_last_node(results, reason):
    c = core("c")
    c.accept_activations([Activation("r1", hidden(), spec())])
    for r in results:
        actions = c.sampled({"r1": r})
    assert of(Deliver, actions)[0].message == TokenMessage("r1", (results[-1],), True, reason)
    assert of(Release, actions) == [Release("r1", keep=True)] and not of(Send, actions) and "r1" not in c.requests


def test_outputs_of_a_request_that_ended_during_the_pass_are_released_not_routed():
    b = core("b")
    b.accept_activations([Activation("r1", hidden(), spec())])
    b.end_request("r1", "cancelled")
    assert b.step_done(ran(Shard("llama", 2, 4, 6), r1=1), StepOutputs({"r1": hidden()})) == [Release("r1")]


# -- failures -------------------------------------------------------------------------------------------------
def failed(actions, rid="r1"):
    (deliver,) = of(Deliver, actions)
    assert deliver.address == ADDR["entry"] and deliver.message.finish_reason == "error"
    assert Release(rid) in actions
    return deliver.message.error


def test_an_input_the_engine_refused_fails_only_its_request():
    b = core("b")
    b.accept_activations([Activation("r1", hidden(), spec("r1")), Activation("r2", hidden(), spec("r2"))])
    actions = b.step_done(ran(Shard("llama", 2, 4, 6), r1=1, r2=1), StepOutputs({"r2": hidden()}, {"r1": "too long"}))
    assert failed(actions) == "node b: too long"
    assert of(Deliver, actions)[0].message.failure == Failure(FailureKind.ERROR, "too long", "b")  # named once
    assert list(b.requests) == ["r2"] and [s.activations[0].request_id for s in of(Send, actions)] == ["r2"]


def test_a_failed_send_or_a_refusal_downstream_fails_the_request_and_tells_the_entry():
    b = core("b")
    b.accept_activations([Activation("r1", hidden(), spec("r1")), Activation("r2", hidden(), spec("r2"))])
    lost = b.send_failed("h:3", (Activation("r1", hidden()),), "unavailable: connection refused", retryable=True)
    assert (
        "sending to h:3 failed: unavailable" in failed(lost)
        and of(Deliver, lost)[0].message.failure.kind is FailureKind.LOST
    )
    refused = b.refused("h:3", [Refusal("r2", Failure(FailureKind.REFUSED, "bad shape"))])
    assert (
        "refused: bad shape" in failed(refused, "r2")
        and of(Deliver, refused)[0].message.failure.kind is FailureKind.REFUSED
    )
    assert not b.requests and b.counters["ended_failed"] == 2


def test_sampling_errors_fail_their_request():
    c = core("c")
    c.accept_activations([Activation("r1", hidden(), spec())])
    assert "sampling failed: ValueError: boom" in failed(c.sampled({"r1": ValueError("boom")}))


def test_a_result_that_cannot_reach_the_entry_ends_the_request_here_and_the_entry_is_told_to_replay():
    c = core("c")
    c.accept_activations([Activation("r1", hidden(), spec())])
    actions = c.deliver_failed("h:9", TokenMessage("r1", (SampleResult(1),)), "unavailable: channel closed")
    assert actions[0] == Release("r1") and not c.requests
    told = of(Deliver, actions)
    assert (
        [d.address for d in told] == ["h:9"]
        and told[0].message.failure.kind is FailureKind.LOST
        and told[0].message.finished
    )
    assert "could not reach the entry (unavailable: channel closed)" in told[0].message.error


def test_a_last_token_that_cannot_reach_the_entry_is_reported_too_and_a_lost_error_ends_nothing_more():
    c = core("c")
    c.accept_activations([Activation("r1", hidden(), spec())])
    c.end_request("r1", "finished")  # the last token ended the request here before its delivery failed
    last = TokenMessage("r1", (SampleResult(STOP),), True, "stop")
    report = of(Deliver, c.deliver_failed("h:9", last, "timeout"))[0].message
    assert report.failure.kind is FailureKind.LOST and report.finish_reason == "error"
    assert not of(Deliver, c.deliver_failed("h:9", report, "timeout"))  # no loop of reports


def test_failing_an_unknown_request_only_releases():
    assert core("b").fail("ghost", "whatever") == [Release("ghost")]


def test_tombstones_are_bounded():
    t = Tombstones(size=3)
    for i in range(5):
        t.add(f"r{i}")
    assert [f"r{i}" in t for i in range(5)] == [False, False, True, True, True]


# -- the one-node ring ----------------------------------------------------------------------------------------
def test_a_one_node_ring_holds_the_queue_for_its_token_in_flight():
    n = core("a")
    n.accept_prompt(spec("r1", nodes=(("a", 0, 6),), entry="a"), tokens(1, 2))
    n.accept_prompt(spec("r2", nodes=(("a", 0, 6),), entry="a"), tokens(3))
    (group,) = n.take_batch()
    n.step_done(group, StepOutputs({"r1": logits(), "r2": logits()}))
    n.accept_prompt(spec("r3", nodes=(("a", 0, 6),), entry="a"), tokens(4))
    assert n.should_wait  # r1 and r2 are being sampled: r3 waits for them to batch together
    n.accept_activations([Activation("r1", tokens(7))])
    assert n.should_wait  # still r2
    n.stop_waiting()  # r2 is a straggler
    assert not n.should_wait
    assert ids(n.take_batch()) == ["r3", "r1"]  # one position each: in arrival order


def test_a_request_whose_next_input_never_comes_expires_and_the_entry_may_replay_it():
    now = [0.0]
    b = NodeCore("b", "llama", CFG, CoreLimits(idle_timeout=5), clock=lambda: now[0])
    b.accept_activations([Activation("r1", hidden(), spec("r1")), Activation("r2", hidden(), spec("r2"))])
    (group,) = b.take_batch()
    now[0] = 4
    b.step_done(group, StepOutputs({"r1": hidden(), "r2": hidden()}))
    now[0] = 8
    b.accept_activations([Activation("r2", hidden())])
    assert b.expire() == []  # r1 idle for 4 s only
    now[0] = 9.5
    actions = b.expire()
    assert "no input for 5s" in failed(actions) and of(Deliver, actions)[0].message.failure.kind is FailureKind.LOST
    assert list(b.requests) == ["r2"] and b.counters["ended_expired"] == 1


def test_a_peers_made_up_end_reason_is_counted_as_unknown():
    """Free text from a peer never becomes a status key of its own (peers refuse a status of over 256 keys)."""
    b = core("b")
    for i in range(3):
        b.accept_activations([Activation(f"r{i}", hidden(), spec(f"r{i}"))])
        b.end_request(f"r{i}", f"reason {i}", caller="a")
    assert b.counters["ended_unknown"] == 3 and not any(k.startswith("ended_reason") for k in b.counters)


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((2, CFG.hidden_size), np.float32),
        np.zeros((1, CFG.hidden_size)),
        np.full((1, CFG.hidden_size), np.nan, np.float32),
    ],
)
def test_a_step_with_any_malformed_output_fails_all_its_requests_before_routing_any(bad):
    b = core("b")
    b.accept_activations([Activation("r1", hidden(), spec("r1")), Activation("r2", hidden(), spec("r2"))])
    (group,) = b.take_batch()
    actions = b.step_done(group, StepOutputs({"r1": hidden(), "r2": bad}))
    assert not of(Send, actions) and len(of(Deliver, actions)) == 2 and not b.requests
    assert "the engine returned" in of(Deliver, actions)[0].message.error
