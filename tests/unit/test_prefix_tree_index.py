"""The entry's index as a tree (node/core/prefix_cache.py): a finished request that shares whole blocks with a
retained one is its branch and counts only its own positions; an entry outlives its branches; a hit on an entry
with branches copies it; forgetting an entry forgets its branches. And the bookkeeping holds whatever clients do."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from node.core.prefix_cache import BLOCK, PrefixHit, PrefixIndex, common_prefix

PREAMBLE = list(range(100, 100 + 2 * BLOCK + 5))  # two whole blocks and a part


def test_a_request_sharing_whole_blocks_with_a_retained_one_is_its_branch_holding_only_the_rest():
    index = PrefixIndex(capacity=1000)
    index.add("a", PREAMBLE + [1, 2, 3])
    index.add("b", PREAMBLE + [4, 5, 6, 7])
    index.add("tiny", PREAMBLE[: BLOCK - 1] + [9])  # less than a block in common: a root of its own
    assert index.branch_of("a") is None and index.branch_of("tiny") is None
    assert index.branch_of("b") == ("a", 2 * BLOCK)
    assert index.positions == len(PREAMBLE) + 3 + (len(PREAMBLE) + 4 - 2 * BLOCK) + BLOCK
    # of equal matches, the one in fewer pieces: c branches from a, not from b
    index.add("c", PREAMBLE + [8])
    assert index.branch_of("c") == ("a", 2 * BLOCK)


def test_an_entry_outlives_its_branches_and_leaves_go_least_recently_used_first():
    index = PrefixIndex(capacity=1000, max_entries=3)
    index.add("a", PREAMBLE + [1])
    index.add("b", PREAMBLE + [2])
    index.add("other", [7, 7, 7])
    index.entries.move_to_end("a", last=False)  # the root, least recently used of all
    assert index.add("d", [8, 8]) == ["b"]  # not a: b needs it
    assert index.evict() == "a"  # a leaf now
    assert index.positions == 5 and not index.children


def test_a_whole_hit_on_an_entry_with_branches_copies_it_and_on_a_leaf_takes_it():
    index = PrefixIndex(capacity=1000)
    index.add("a", PREAMBLE + [1])
    index.add("b", PREAMBLE + [2, 3])
    index.take(PrefixHit("a", len(PREAMBLE) + 1))
    assert "a" in index and index.partial_hits == 1  # b's first blocks are a's
    index.take(PrefixHit("b", len(PREAMBLE) + 2))
    assert "b" not in index and not index.children
    index.take(PrefixHit("a", len(PREAMBLE) + 1))
    assert "a" not in index and index.positions == 0


def test_forgetting_an_entry_forgets_its_branches():
    index = PrefixIndex(capacity=1000)
    index.add("a", PREAMBLE + [1])
    index.add("b", PREAMBLE + [2] * 20)
    index.add("c", PREAMBLE + [2] * 20 + [3])
    assert index.branch_of("c") == ("b", (len(PREAMBLE) + 20) // BLOCK * BLOCK)
    assert index.remove("a")
    assert len(index) == 0 and index.positions == 0 and not index.parents and not index.children


def check(index: PrefixIndex) -> None:
    """What the nodes are told stays true: a branch's parent is held and shares its first `at` tokens, whole
    blocks; positions count each entry's own; the children counts are the branches'."""
    children: dict[str, int] = {}
    held = 0
    for entry, tokens in index.entries.items():
        parent, at = index.parents.get(entry, ("", 0))
        if parent:
            assert parent in index.entries and at % BLOCK == 0 and 0 < at < len(tokens)
            assert common_prefix(index.entries[parent], tokens) >= at
            assert index.scopes[parent] == index.scopes[entry]
            children[parent] = children.get(parent, 0) + 1
        held += len(tokens) - at
    assert dict(index.children) == children and index.positions == held <= index.capacity
    assert len(index) <= index.max_entries


words = st.lists(st.integers(0, 3), min_size=1, max_size=6)  # a prompt: a few blocks from a small alphabet
actions = st.lists(st.tuples(st.sampled_from(["add", "hit", "remove", "evict"]), words, st.sampled_from("xy")))


@settings(max_examples=150, deadline=None)
@given(actions)
def test_the_tree_stays_whole_whatever_clients_do(steps):
    index = PrefixIndex(capacity=200, max_entries=6)
    for i, (what, blocks, scope) in enumerate(steps):
        tokens = [t for b in blocks for t in [b] * BLOCK] + [i]  # whole blocks in common, a tail its own
        if what == "add":
            evicted = index.add(f"r{i}", tokens, scope)
            assert all(e not in index for e in evicted)
        elif what == "hit" and (hit := index.longest(tokens + [99], scope)) is not None:
            index.take(hit)
        elif what == "remove" and index.entries:
            index.remove(next(iter(index.entries)))
        elif what == "evict":
            index.evict()
        check(index)
