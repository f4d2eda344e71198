"""Retained caches as a tree: a request's cache that shares its first blocks with a retained one is held only past
them, as a branch; a request resuming from a branch gets the chain's positions copied, root first, into one cache of
its own, and answers exactly as a request that computes every position. Leaves go first when room runs out, so a
preamble outlives the conversations that share it. On numpy and ggml, one shard and a chain of three (MLX: a chain of
branches)."""

from __future__ import annotations

import numpy as np
import pytest

from node.core.prefix_cache import BLOCK, PrefixIndex
from shards.engines.retained import resume_all
from tests.engines.test_prefix_reuse import chain, turn
from tests.support.tolerance import regrouped_atol

ENGINES = ["numpy", "ggml"]


def finish(engines, index: PrefixIndex, rid: str, prompt: np.ndarray, tokens: list[int]) -> np.ndarray:
    """What the entry and the nodes do when a request finishes: every shard keeps its cache, the index records its
    tokens and names the entry it branches from, and every shard then holds only the rest."""
    held = np.concatenate([prompt, tokens[:-1]])
    for e in engines:
        assert e.retain(rid) == []
    assert index.add(rid, held) == []
    if (branch := index.branch_of(rid)) is not None:
        assert all(e.retained.branch(rid, *branch) for e in engines)
    return held


def served(engines, index: PrefixIndex, rid: str, prompt: np.ndarray, n: int = 4):
    """A request through the index: resumed from the longest retained prefix, then decoded greedily."""
    hit = index.longest(prompt)
    start = 0
    if hit is not None:
        assert resume_all(engines, rid, hit.entry_id, hit.tokens)
        index.take(hit)
        start = hit.tokens
    return start, *turn(engines, rid, prompt, start, n)


def check_exact(engine: str, nodes: int, got: tuple, prompt: np.ndarray, n: int = 4) -> None:
    _, tokens, logits = got
    want_tokens, want_logits = turn(chain(engine, nodes), "fresh", prompt, 0, n)
    assert tokens == want_tokens
    for a, b in zip(logits, want_logits):
        np.testing.assert_allclose(a, b, atol=regrouped_atol(engine), rtol=0)


@pytest.mark.parametrize("nodes", [1, 3])
@pytest.mark.parametrize("engine", ENGINES)
def test_conversations_sharing_a_preamble_hold_it_once_and_each_resumes_exactly(engine, nodes):
    rng = np.random.default_rng(11)
    preamble = rng.integers(0, 256, 40)  # two whole blocks and a part
    engines, index = chain(engine, nodes), PrefixIndex(capacity=10_000)

    prompts = {c: np.concatenate([preamble, rng.integers(0, 256, 10 + i)]) for i, c in enumerate("abc")}
    held = {}
    for c, prompt in prompts.items():
        got = served(engines, index, c, prompt)
        check_exact(engine, nodes, got, prompt)
        held[c] = finish(engines, index, c, prompt, got[1])

    # a holds the preamble; b and c hold only what follows its last whole block
    shared = len(preamble) // BLOCK * BLOCK
    assert index.branch_of("a") is None and index.branch_of("b") == index.branch_of("c") == ("a", shared)
    for e in engines:
        lengths = {c: e.retained.caches[c].length for c in "abc"}
        assert lengths == {"a": len(held["a"]), "b": len(held["b"]) - shared, "c": len(held["c"]) - shared}
        assert e.retained.length("b") == len(held["b"]) and e.retained.branches == 2
    assert index.positions == sum(len(h) for h in held.values()) - 2 * shared

    # b's next turn: its chain (a's first blocks, then its own) copied into one cache; b, a leaf, leaves the store
    follow = np.concatenate([held["b"], [7], rng.integers(0, 256, 6)])
    got = served(engines, index, "b2", follow)
    assert got[0] == len(held["b"])
    check_exact(engine, nodes, got, follow)
    assert all("b" not in e.retained and "a" in e.retained and "c" in e.retained for e in engines)
    for e in engines:
        e.release("b2")

    # a side request sharing the preamble and part of a's own turn: a copy, and a stays (it has a branch)
    side = np.concatenate([held["a"][: shared + 5], rng.integers(0, 256, 8)])
    got = served(engines, index, "side", side)
    assert got[0] == shared + 5
    check_exact(engine, nodes, got, side)
    assert all("a" in e.retained for e in engines)


@pytest.mark.parametrize("engine", [*ENGINES, "mlx"])
def test_a_branch_of_a_branch_resumes_through_its_whole_chain(engine):
    rng = np.random.default_rng(5)
    engines, index = chain(engine, 1), PrefixIndex(capacity=10_000)
    root = np.concatenate([rng.integers(0, 256, 20), rng.integers(0, 256, 30)])
    got = served(engines, index, "r", root)
    held_r = finish(engines, index, "r", root, got[1])
    middle = np.concatenate([held_r[:36], rng.integers(0, 256, 30)])
    got = served(engines, index, "m", middle)
    held_m = finish(engines, index, "m", middle, got[1])
    leaf = np.concatenate([held_m[:50], rng.integers(0, 256, 9)])
    got = served(engines, index, "l", leaf)
    held_l = finish(engines, index, "l", leaf, got[1])
    assert index.branch_of("m") == ("r", 32) and index.branch_of("l") == ("m", 48)
    assert engines[0].retained.caches["l"].length == len(held_l) - 48

    deep = np.concatenate([held_l, [3], rng.integers(0, 256, 5)])
    got = served(engines, index, "deep", deep)
    assert got[0] == len(held_l)  # r's first 32, m's next 16, l's own: three pieces
    check_exact(engine, 1, got, deep)


def test_room_runs_out_at_the_leaves_least_recently_used_first():
    (e,) = chain("numpy", 1)
    rng = np.random.default_rng(3)
    preamble = rng.integers(0, 256, 32)
    for rid in ("root", "x", "y"):
        turn([e], rid, np.concatenate([preamble, rng.integers(0, 256, 12)]), 0, 1)
        e.retain(rid)
    assert e.retained.branch("x", "root", 32) and e.retained.branch("y", "root", 32)
    assert not e.retained.branch("root", "x", 32)  # a parent never becomes a branch of its branch
    assert not e.retained.branch("x", "y", 32)  # already a branch
    e.retained.caches.move_to_end("root", last=False)  # the root is the least recently used of all
    freed = e.retained.shrink(e.retained.nbytes - 1)
    assert freed == ["x"]  # not the root: its branches need it
    assert e.retained.shrink(0) == ["y", "root"]
    assert e.retained.nbytes == 0 and not e.retained.parents and not e.retained.children


def test_dropping_a_retained_cache_drops_its_branches():
    (e,) = chain("numpy", 1)
    rng = np.random.default_rng(4)
    preamble = rng.integers(0, 256, 32)
    for rid in ("root", "x"):
        turn([e], rid, np.concatenate([preamble, rng.integers(0, 256, 12)]), 0, 1)
        e.retain(rid)
    assert e.retained.branch("x", "root", 16)
    assert e.retained.drop("root")
    assert "x" not in e.retained and e.retained.nbytes == 0 and not e.retained.children
