"""The entry's index of retained prefixes (node/core/prefix_cache.py): the longest shared prefix wins, a hit always
leaves a token to compute, entries leave least recently used first and within their capacity, and a hit takes its
entry out."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from node.core.plan import PlanError
from node.core.prefix_cache import PrefixHit, PrefixIndex, common_prefix
from node.core.requests import Activation
from tests.support.factories import hidden, spec
from tests.unit.test_core import core


def test_common_prefix_counts_the_leading_tokens_two_sequences_share():
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert common_prefix(np.array([9]), np.array([1])) == 0
    assert common_prefix(np.array([], dtype=np.int64), np.array([1])) == 0


def test_the_longest_shared_prefix_wins_and_always_leaves_one_token_to_compute():
    index = PrefixIndex(capacity=100)
    index.add("short", [1, 2, 3])
    index.add("long", [1, 2, 3, 4, 5, 6])
    index.add("other", [7, 8, 9, 10])
    assert index.longest([1, 2, 3, 4, 5, 6, 7]) == PrefixHit("long", 6)
    assert index.longest([1, 2, 3, 4, 5, 6]) == PrefixHit("long", 5)  # the whole prompt: its last is computed
    assert index.longest([1, 2, 9]) in (PrefixHit("short", 2), PrefixHit("long", 2))
    assert index.longest([5, 5]) is None and index.misses == 1


def test_a_minimum_keeps_tiny_matches_from_counting():
    index = PrefixIndex(capacity=100, min_tokens=4)
    index.add("a", [1, 2, 3, 4, 5])
    assert index.longest([1, 2, 3, 9]) is None
    assert index.longest([1, 2, 3, 4, 9]) == PrefixHit("a", 4)
    assert index.add("tiny", [1, 2]) == ["tiny"]  # shorter than any useful hit: not kept


def test_a_hit_on_a_whole_entry_takes_it_and_is_counted():
    index = PrefixIndex(capacity=100)
    index.add("a", [1, 2, 3, 4])
    hit = index.longest([1, 2, 3, 4, 5])
    index.take(hit)
    assert "a" not in index and index.positions == 0
    assert (index.hits, index.hit_tokens) == (1, 4)
    assert index.longest([1, 2, 3, 4, 5]) is None


def test_a_hit_on_part_of_an_entry_leaves_it_for_the_next_client():
    """One conversation's cache and a side request sharing only its preamble: the side request copies the preamble,
    the conversation's entry stays (most recently used), and its next turn still finds all of it."""
    index = PrefixIndex(capacity=100)
    index.add("conversation", [1, 2, 3, 4, 5, 6, 7, 8])
    index.add("older", [9, 9, 9])
    side = index.longest([1, 2, 3, 40, 50])
    assert side == PrefixHit("conversation", 3)
    index.take(side)
    assert "conversation" in index and index.positions == 11 and index.partial_hits == 1
    assert list(index.entries) == ["older", "conversation"]  # used: the last to leave
    index.add("side", [1, 2, 3, 40, 50])
    assert index.longest([1, 2, 3, 4, 5, 6, 7, 8, 9]) == PrefixHit("conversation", 8)


def test_entries_leave_least_recently_used_first_to_stay_within_capacity():
    index = PrefixIndex(capacity=10, max_entries=3)
    assert index.add("a", range(4)) == [] and index.add("b", range(4)) == []
    assert index.add("c", range(4)) == ["a"]  # 12 positions > 10
    assert index.positions == 8 and index.evictions == 1
    assert index.add("d", [1]) == [] and index.add("e", [2]) == ["b"]  # 4 entries > 3
    assert list(index.entries) == ["c", "d", "e"]
    assert index.add("huge", range(11)) == ["huge"] and "huge" not in index  # could never fit
    assert index.evict() == "c" and index.remove("d") and not index.remove("d")
    assert index.positions == 1 and len(index) == 1


def test_bad_input_is_refused():
    index = PrefixIndex(capacity=10)
    index.add("a", [1, 2])
    with pytest.raises(ValueError):
        index.add("a", [1, 2])
    with pytest.raises(ValueError):
        index.add("m", [[1, 2]])
    with pytest.raises(ValueError):
        PrefixIndex(capacity=-1)
    with pytest.raises(ValueError):
        PrefixHit("a", 0)


def test_a_prefix_retained_by_one_plan_is_not_offered_to_another():
    index = PrefixIndex(capacity=100)
    index.add("a", [1, 2, 3, 4], scope="n1:0-30")
    assert index.longest([1, 2, 3, 4, 5], scope="n1:0-15,n2:15-30") is None
    assert index.longest([1, 2, 3, 4, 5], scope="n1:0-30") == PrefixHit("a", 4)
    index.take(PrefixHit("a", 4))
    assert not index.scopes and index.positions == 0


def test_a_reused_prefix_counts_against_the_positions_a_request_declared():
    reusing = dataclasses.replace(spec("r1", max_tokens=2), prompt_tokens=4, reuse_from="done", reuse_positions=3)
    b = core("b")
    assert b.accept_activations([Activation("r1", hidden(1), reusing)]) == []  # 3 reused + 1 sent: the prompt
    assert b.requests["r1"].positions_in == 4
    (refused,) = b.accept_activations([Activation("r1", hidden(3))])  # 4 + 3 > 4 prompt + 2 new
    assert "more than the 6 it declared" in refused.reason
    with pytest.raises(PlanError):
        dataclasses.replace(reusing, reuse_positions=4)  # nothing left to compute


def test_a_client_is_known_by_a_digest_of_its_api_key_from_either_header():
    from node.http.middleware import client_key

    alice = client_key(b"Bearer alice", b"")
    assert alice == client_key(b"", b"alice") and len(alice) == 32 and "alice" not in alice
    assert alice != client_key(b"Bearer bob", b"") and client_key(b"", b"") == ""


def test_per_key_scopes_keep_one_clients_prefixes_from_another():
    from node.runtime.entry import _scope

    index = PrefixIndex(capacity=100)
    plan = ()
    index.add("a", [1, 2, 3, 4], scope=_scope(plan, "alice"))
    assert index.longest([1, 2, 3, 4, 5], scope=_scope(plan, "bob")) is None
    assert index.longest([1, 2, 3, 4, 5], scope=_scope(plan)) is None  # shared requests don't see keyed ones
    assert index.longest([1, 2, 3, 4, 5], scope=_scope(plan, "alice")) == PrefixHit("a", 4)
