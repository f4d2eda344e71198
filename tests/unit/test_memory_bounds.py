"""Memory a peer can make a node hold is bounded: one entry node's requests get at most their share of the KV
budget, and no request brings more positions than it declared (the size its reservation was made for)."""

import dataclasses

import numpy as np
import pytest

from node.core.admission import Admission, CoreLimits
from node.core.failures import Failed, FailureKind
from node.core.node_core import NodeCore
from node.core.plan import PlanError
from node.core.requests import Activation
from shards.model.shard import Shard
from tests.support.factories import CFG, hidden, spec, tokens


def request(rid, entry="entry", prompt_tokens=10, max_tokens=6):
    return dataclasses.replace(spec(rid, max_tokens=max_tokens, entry=entry), prompt_tokens=prompt_tokens)


def test_one_entrys_requests_reserve_at_most_their_share_and_others_still_get_in():
    per_request = Admission("b", "llama", CFG, CoreLimits(), members=None, serves=lambda s: True).kv_bytes(
        Shard("llama", 2, 4, 6), 16
    )
    a = Admission(
        "b",
        "llama",
        CFG,
        CoreLimits(kv_budget=10 * per_request, kv_entry_share=0.5),
        members=None,
        serves=lambda s: True,
    )
    held = {}
    for i in range(5):  # half the budget: the flooding entry's share
        held[f"f{i}"] = a.admit(request(f"f{i}"), held, now=0.0)
    with pytest.raises(Failed, match="entry entry .* may hold at most") as busy:
        a.admit(request("f5"), held, now=0.0)
    assert busy.value.kind is FailureKind.BUSY
    for i, entry in enumerate(["c", "c", "a", "a"]):  # the other entries still find room
        held[f"o{i}"] = a.admit(request(f"o{i}", entry=entry), held, now=0.0)
    held["own"] = a.admit(request("own", entry="b"), held, now=0.0)  # and the node's own requests
    assert a.kv_reserved == 10 * per_request


def test_a_request_larger_than_one_entrys_share_is_refused_outright():
    a = Admission(
        "b", "llama", CFG, CoreLimits(kv_budget=1 << 20, kv_entry_share=0.1), members=None, serves=lambda s: True
    )
    big = request("r1", prompt_tokens=200, max_tokens=56)  # 0.125 MiB on b's two layers: within the budget
    with pytest.raises(PlanError, match="more than one entry's share") as e:
        a.admit(big, {}, now=0.0)
    assert not isinstance(e.value, Failed) and a.kv_reserved == 0


def test_the_share_must_be_a_fraction():
    with pytest.raises(ValueError, match="kv_entry_share"):
        CoreLimits(kv_entry_share=0)


def test_a_prompt_longer_than_declared_is_refused_reserving_nothing():
    a = NodeCore("a", "llama", CFG, CoreLimits(kv_budget=1 << 30))
    with pytest.raises(PlanError, match="sent 30 positions, more than the 7 it declared"):
        a.accept_prompt(request("r1", prompt_tokens=1), tokens(*range(30)))
    assert not a.requests and a.kv_reserved == 0


def test_activations_beyond_what_was_declared_are_refused():
    b = NodeCore("b", "llama", CFG, CoreLimits())
    declared = request("r1", prompt_tokens=4, max_tokens=2)  # at most 6 positions
    assert b.accept_activations([Activation("r1", hidden(4), declared, partial=True)]) == []
    assert b.accept_activations([Activation("r1", hidden(2))]) == []
    (refusal,) = b.accept_activations([Activation("r1", hidden(1))])
    assert "sent 7 positions, more than the 6 it declared" in refusal.reason
    (refusal,) = b.accept_activations([Activation("r2", hidden(9), request("r2", prompt_tokens=4, max_tokens=2))])
    assert "sent 9 positions" in refusal.reason and "r2" not in b.requests


def test_a_whole_generation_stays_within_its_declaration():
    """prompt + max_tokens positions: the last sampled token is never fed back, so an honest ring never nears it."""
    a = NodeCore("a", "llama", CFG, CoreLimits())
    declared = request("r1", prompt_tokens=3, max_tokens=4)
    a.accept_prompt(declared, tokens(1, 2, 3))
    for token in range(3):  # the tokens sampled before the last come back to the first node
        assert a.accept_activations([Activation("r1", np.array([token], np.int64))]) == []
    assert a.requests["r1"].positions_in == 6 <= declared.positions
