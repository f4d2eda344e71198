"""The node core's checks on what peers ask of it: plans name only members it knows, data goes only where it knows
them, each message comes from its proper sender, and one entry can't take every slot. Plain values, as in
tests/unit/test_core.py (whose helpers these tests share)."""

import dataclasses

import pytest

from node.core.actions import Deliver, Release, Send
from node.core.admission import CoreLimits
from node.core.failures import FailureKind
from node.core.node_core import NodeCore
from node.core.plan import PlanError, PlanStep, RequestSpec
from node.core.requests import Activation
from node.core.step_plan import StepOutputs
from shards.decoding.sampling import SampleResult, SamplingParams
from shards.model.shard import Shard
from tests.support.factories import ADDR, CFG, STOP, hidden, logits, spec, tokens


def guarded(node_id, **limits):
    """A node that knows exactly the members of ADDR (as membership would have found them)."""
    return NodeCore(node_id, "llama", CFG, CoreLimits(**limits), members=lambda: dict(ADDR))


def test_a_plan_naming_a_stranger_is_refused():
    b = guarded("b")
    stranger = RequestSpec(
        "r1",
        (
            PlanStep("a", ADDR["a"], Shard("llama", 0, 2, 6)),
            PlanStep("b", ADDR["b"], Shard("llama", 2, 4, 6)),
            PlanStep("evil", "h:66", Shard("llama", 4, 6, 6)),
        ),
        SamplingParams(temperature=0),
        3,
        frozenset({STOP}),
        "entry",
        ADDR["entry"],
    )
    (refusal,) = b.accept_activations([Activation("r1", hidden(), stranger)])
    assert (
        refusal.failure.kind is FailureKind.BUSY and "not a member" in refusal.reason
    )  # busy: it may be a node that has just joined
    assert not b.requests


def test_a_plans_addresses_never_redirect_data_a_node_sends_to_members_where_it_knows_them():
    """The plan carries the entry's view of the addresses; another node may know a member by another name (a
    hostname, another interface), and a plan must not send activations or answers elsewhere."""
    b, c = guarded("b"), guarded("c")
    elsewhere = dataclasses.replace(
        spec("r1"),
        entry_address="h:66",
        plan=tuple(dataclasses.replace(step, address=f"h:6{i}") for i, step in enumerate(spec("r1").plan)),
    )
    assert b.accept_activations([Activation("r1", hidden(), elsewhere)]) == []
    (send,) = b.step_done(b.take_batch()[0], StepOutputs({"r1": hidden()}))
    assert send.address == ADDR["c"]
    assert c.accept_activations([Activation("r1", hidden(), elsewhere)]) == []
    c.step_done(c.take_batch()[0], StepOutputs({"r1": logits()}))
    actions = c.sampled({"r1": SampleResult(5)})
    assert {type(a): a.address for a in actions} == {Deliver: ADDR["entry"], Send: ADDR["a"]}


def test_with_authenticated_callers_each_message_must_come_from_its_proper_sender():
    a, b = guarded("a"), guarded("b")
    with pytest.raises(PlanError, match="from node 'c'"):
        a.accept_prompt(spec(), tokens(1, 2), caller="c")  # only the entry sends a prompt
    a.accept_prompt(spec(), tokens(1, 2), caller="entry")
    assert "from node 'b'" in a.accept_activations([Activation("r1", tokens(5))], caller="b")[0].reason
    assert a.accept_activations([Activation("r1", tokens(5))], caller="c") == []  # the last node's next token
    assert "from node 'c'" in b.accept_activations([Activation("r1", hidden(), spec())], caller="c")[0].reason
    assert b.accept_activations([Activation("r1", hidden(), spec())], caller="a") == []


def test_only_the_entry_or_a_plan_member_may_end_a_request_and_strangers_none():
    b = guarded("b")
    b.accept_activations([Activation("r1", hidden(), spec())])
    assert b.end_request("r1", "cancelled", caller="mallory") == [] and "r1" in b.requests
    assert b.end_request("r1", "cancelled", caller="entry") == [Release("r1", keep=True)] and "r1" not in b.requests
    assert b.end_request("unknown", "cancelled", caller="mallory") == [] and "unknown" not in b.ended
    assert b.counters["end_refused"] == 2


def test_only_the_entry_of_both_requests_may_make_one_retained_cache_a_branch_of_another():
    """A branch hands one request's keys and values to every later request that resumes from the other: a peer
    other than their entry could make answers silently wrong, so the node ignores (and counts) its claim."""
    b = guarded("b")
    b.accept_activations([Activation(r, hidden(), spec(r)) for r in ("r1", "r2", "r3")])
    b.accept_activations([Activation("alien", hidden(), spec("alien", entry="a"))])
    assert b.end_request("r1", "finished", caller="entry") == [Release("r1", keep=True)]
    assert b.end_request("alien", "finished", caller="a") == [Release("alien", keep=True)]
    # a node of the plan ends it first (the last node, as it samples the last token); the entry's branch follows
    assert b.end_request("r2", "finished", caller="c") == [Release("r2", keep=True)]
    assert b.end_request("r2", "finished", caller="a", branch=("r1", 16)) == [Release("r2")]
    assert b.end_request("r2", "finished", caller="entry", branch=("alien", 16)) == [Release("r2")]
    assert b.end_request("r2", "finished", caller="entry", branch=("r1", 16)) == [Release("r2", branch=("r1", 16))]
    assert b.end_request("r3", "failed", caller="entry", branch=("r1", 16)) == [Release("r3")]  # nothing kept
    assert b.counters["branch_refused"] == 3


def test_one_entry_node_cannot_take_every_request_slot():
    b = guarded("b", max_requests=10, max_requests_per_entry=3)
    refused = b.accept_activations([Activation(f"r{i}", hidden(), spec(f"r{i}")) for i in range(4)])
    assert [(r.request_id, r.failure.kind) for r in refused] == [
        ("r3", FailureKind.BUSY)
    ] and "limit for one entry" in refused[0].reason
    other = dataclasses.replace(spec("x"), entry_node_id="a", entry_address=ADDR["a"])
    assert b.accept_activations([Activation("x", hidden(), other)]) == []  # another entry still gets in


def test_a_replay_cannot_skip_more_sampler_draws_than_its_prompt_holds():
    """`resumed` counts generated tokens that are now part of the prompt; a peer's larger number (up to 2^31) would
    have the last node draw that many numbers before sampling."""
    with pytest.raises(PlanError, match="resumed"):
        dataclasses.replace(spec(), prompt_tokens=4, resumed=5)
