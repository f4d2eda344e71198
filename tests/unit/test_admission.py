"""Admission on its own: a request is taken with its KV cache reserved, or refused reserving nothing; its end frees
what it reserved. (How the core uses it, with every refusal, is in test_core.py.)"""

import dataclasses

import pytest

from node.core.admission import Admission, CoreLimits
from node.core.failures import Failed
from node.core.plan import PlanError
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
    "refuse, error",
    [
        (dict(kv_budget=1), PlanError),  # more than the whole budget: never
        (dict(max_requests=1), Failed),  # one held already: not now
        (dict(members=lambda: {"b": "h:2"}), Failed),  # the plan names nodes b doesn't know (yet)
        (dict(serves=lambda shard: False), PlanError),  # b has not fetched these layers
    ],
)
def test_a_refused_request_reserves_nothing(refuse, error):
    a = admission(**refuse)
    held = {"r0": a.admit(spec("r0"), {}, now=0.0)} if "max_requests" in refuse else {}
    before = a.kv_reserved
    with pytest.raises(error):
        a.admit(spec("r1"), held, now=0.0)
    assert a.kv_reserved == before


def test_a_draining_node_takes_nothing_new():
    a = admission()
    a.draining = True
    with pytest.raises(PlanError, match="shutting down"):
        a.admit(spec("r1"), {}, now=0.0)
