"""Admission on its own: a request is taken with its KV cache reserved, or refused reserving nothing; its end frees
what it reserved. (How the core uses it, with every refusal, is in test_core.py.)"""

import dataclasses

import pytest

from node.core.admission import Admission, CoreLimits
from node.core.failures import Failed, Failure, FailureKind
from shards.model.shard import Shard
from tests.support.factories import CFG, spec


def admission(node_id="b", members=None, serves=lambda shard: True, **limits):
    return Admission(node_id, "llama", CFG, CoreLimits(**limits), members=members, serves=serves)


def sized(rid, prompt_tokens, max_tokens):
    return dataclasses.replace(spec(rid, max_tokens=max_tokens), prompt_tokens=prompt_tokens)


def test_an_admitted_request_reserves_its_kv_cache_until_released():
    a = admission()
    req = a.admit(sized("r1", 10, 6), {}, now=5.0)
    assert (req.step_index, req.last_active) == (1, 5.0)  # node b is the plan's second step
    assert req.kv_bytes == a.kv_bytes(Shard("llama", 2, 4, 6), 16) == a.kv_reserved
    a.release(req)
    assert a.kv_reserved == 0


@pytest.mark.parametrize(
    "refuse, kind",
    [
        (dict(kv_budget=1), FailureKind.REFUSED),  # more than the whole budget: never
        (dict(max_requests=1), FailureKind.BUSY),  # one held already: not now
        (dict(members=lambda: {"b": "h:2"}), FailureKind.BUSY),  # the plan names nodes b doesn't know (yet)
        (dict(serves=lambda shard: False), FailureKind.REFUSED),  # b has not fetched these layers
    ],
)
def test_a_refused_request_reserves_nothing(refuse, kind):
    a = admission(**refuse)
    held = {"r0": a.admit(spec("r0"), {}, now=0.0)} if "max_requests" in refuse else {}
    before = a.kv_reserved
    with pytest.raises(Failed) as refused:
        a.admit(spec("r1"), held, now=0.0)
    assert refused.value.kind is kind and a.kv_reserved == before


def test_a_refusal_names_the_node_once_through_its_failure():
    with pytest.raises(Failed) as refused:
        admission(kv_budget=1).admit(spec("r1"), {}, now=0.0)
    assert refused.value.failure.node == "b" and "node b" not in refused.value.failure.detail
    assert str(refused.value).startswith("node b: ") and str(refused.value).count("node b") == 1


def test_a_draining_node_takes_nothing_new():
    a = admission()
    a.draining = True
    with pytest.raises(Failed, match="^node b: shutting down$") as refused:
        a.admit(spec("r1"), {}, now=0.0)
    assert refused.value.failure == Failure(FailureKind.REFUSED, "shutting down", "b")


def test_positions_whose_values_the_engine_keeps_twice_are_charged_a_third_value():
    """The ggml engine keeps a request's first positions' values in two layouts, one per attention kernel (its
    cells.py): a budget that charged only a key and a value would let its requests outgrow the budget."""
    shard, plain, twice = Shard("llama", 2, 4, 6), admission(), admission(kv_values_twice=100)
    per_value = plain.kv_bytes(shard, 1) // 2
    assert twice.kv_bytes(shard, 60) == plain.kv_bytes(shard, 60) + 60 * per_value  # all under the bound
    assert twice.kv_bytes(shard, 500) == plain.kv_bytes(shard, 500) + 100 * per_value  # the first 100 only
