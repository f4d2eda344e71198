"""Prefix reuse is exact: a request that takes over a finished request's cache (node/core/prefix_cache.py finds it,
shards/engines/retained.py holds it) and computes only its new tokens gets the outputs of a request that computes
them all; on every engine (numpy and ggml as one shard and a chain of three). A cache evicted on any shard means a
full prefill, never a wrong answer."""

from __future__ import annotations

import numpy as np
import pytest

from node.core.prefix_cache import PrefixIndex
from shards.engines.base import StepInput
from shards.engines.registry import engine_class
from shards.engines.retained import resume_all
from shards.formats.loader import load_config
from shards.model.shard import Shard
from tests.conftest import FIXTURES
from tests.support.tolerance import regrouped_atol

MODEL = FIXTURES / "llama"  # 6 layers
CUTS = {1: [(0, 6)], 3: [(0, 2), (2, 4), (4, 6)]}


def chain(engine: str, nodes: int, retain_bytes: int = 1 << 30):
    cfg = load_config(MODEL)
    engines = [engine_class(engine)(MODEL, Shard("m", a, b, cfg.n_layers), cfg) for a, b in CUTS[nodes]]
    for e in engines:
        e.retained.limit = retain_bytes
    return engines


def step(engines, rid: str, tokens: np.ndarray) -> np.ndarray:
    out = None
    for i, e in enumerate(engines):
        item = (
            StepInput(rid, tokens=tokens, max_positions=128)
            if i == 0
            else StepInput(rid, hidden=out, max_positions=128)
        )
        out = e.forward([item])[0]
    return out


def turn(engines, rid: str, prompt: np.ndarray, start: int, n: int) -> tuple[list[int], list[np.ndarray]]:
    """Prefill prompt[start:] (the cache holds prompt[:start]) and decode n greedy tokens."""
    logits = [step(engines, rid, prompt[start:])]
    tokens = [int(np.argmax(logits[-1]))]
    for _ in range(n - 1):
        logits.append(step(engines, rid, np.array(tokens[-1:])))
        tokens.append(int(np.argmax(logits[-1])))
    return tokens, logits


def converse(engines, index: PrefixIndex | None, turns: int = 3, seed: int = 0):
    """A chat: each turn resends the whole conversation plus a new message; with `index`, finished turns are
    retained and the next one resumes from the longest prefix every shard still holds."""
    rng = np.random.default_rng(seed)
    conversation = rng.integers(0, 256, 30)
    outs = []
    for t in range(turns):
        rid = f"turn{t}"
        prompt = np.concatenate([conversation, rng.integers(0, 256, 7)])
        start = 0
        if index is not None and (hit := index.longest(prompt)) is not None:
            if resume_all(engines, rid, hit.entry_id, hit.tokens):
                index.take(hit)
                start = hit.tokens
            else:
                index.remove(hit.entry_id)
        tokens, logits = turn(engines, rid, prompt, start, 5)
        outs.append((start, tokens, logits))
        held = np.concatenate([prompt, tokens[:-1]])  # the last token was sampled, never fed
        assert all(e.cache_length(rid) == len(held) for e in engines)
        if index is not None:
            for e in engines:
                for gone in e.retain(rid):
                    index.remove(gone)
            if all(rid in e.retained for e in engines):
                for gone in index.add(rid, held):
                    for e in engines:
                        e.retained.drop(gone)
        else:
            for e in engines:
                e.release(rid)
        conversation = np.concatenate([held, tokens[-1:]])
    return outs


@pytest.mark.parametrize(
    "engine,nodes", [("numpy", 1), ("numpy", 3), ("ggml", 1), ("ggml", 3), ("tinygrad", 1), ("mlx", 1)]
)  # tinygrad compiles per shape: one chain keeps it short
def test_each_turn_prefills_only_its_new_tokens_and_answers_as_a_full_prefill_does(engine, nodes):
    index = PrefixIndex(capacity=10_000)
    cached, full = converse(chain(engine, nodes), index), converse(chain(engine, nodes), None)
    assert [start for start, _, _ in cached] == [0, 41, 53]  # 30 + 7 + 4 held after turn 1; +7 +5 after turn 2
    assert index.hits == 2 and index.hit_tokens == 41 + 53
    for (_, tokens, logits), (_, ref_tokens, ref_logits) in zip(cached, full):
        assert tokens == ref_tokens
        for a, b in zip(logits, ref_logits):
            assert np.allclose(a, b, atol=regrouped_atol(engine), rtol=0)


@pytest.mark.parametrize("engine", ["numpy", "ggml"])
def test_a_shard_that_evicted_the_prefix_makes_the_request_prefill_everything(engine):
    engines, index = chain(engine, 3), PrefixIndex(capacity=10_000)
    full = converse(chain(engine, 3), None, turns=2)
    original = engines[1].retain

    def evicting(rid):  # the middle node's room ran out: it kept nothing
        freed = original(rid)
        engines[1].retained.drop(rid)
        return freed

    engines[1].retain = evicting
    cached = converse(engines, index, turns=2)
    assert [start for start, _, _ in cached] == [0, 0]  # never indexed: no shard-complete prefix to offer
    assert cached[1][1] == full[1][1]

    # evicted after it was indexed: the lookup finds it, resuming fails, the others let go of their part
    engines, index = chain(engine, 3), PrefixIndex(capacity=10_000)
    converse(engines, index, turns=1)
    engines[2].retained.shrink(0)
    assert engines[2].retained.evictions == 1
    prompt = np.concatenate([index.entries["turn0"], [1, 2, 3]])
    hit = index.longest(prompt)
    assert hit is not None and not resume_all(engines, "next", hit.entry_id, hit.tokens)
    assert all(e.cache_length("next") == 0 and "turn0" not in e.retained for e in engines)
    assert all(e.retained.nbytes == 0 and not e.caches for e in engines)


def test_retained_caches_stay_within_their_limit_least_recently_used_out():
    (e,) = chain("numpy", 1)
    for i in range(3):
        step([e], f"r{i}", np.arange(1, 20) + i)
    one = e.caches["r0"].nbytes
    e.retained.limit = 2 * one
    assert e.retain("r0") == [] and e.retain("r1") == []
    assert e.retain("r2") == ["r0"]  # the oldest goes
    assert e.retained.nbytes == 2 * one and e.retained.evictions == 1
    assert not e.resume("x", "r0", 5) and e.resume("x", "r1", 5) and e.cache_length("x") == 5
    e.retained.limit = 0
    assert e.retain("x") == ["x"]  # a zero limit keeps nothing
    e.retained.clear()
    assert e.retained.nbytes == 0 and not e.caches


@pytest.mark.parametrize("engine", ["numpy", "ggml"])
def test_a_shared_system_prompt_reuses_only_the_shared_positions_and_overwrites_the_rest(engine):
    system = np.arange(3, 23)  # 20 tokens both requests start with; what follows differs
    first, second = np.concatenate([system, np.arange(100, 115)]), np.concatenate([system, np.arange(50, 58)])
    engines, index = chain(engine, 1), PrefixIndex(capacity=1000)
    turn(engines, "a", first, 0, 3)
    engines[0].retain("a")
    index.add("a", np.concatenate([first, [0, 0]]))  # what "a" held: its prompt and two fed tokens
    hit = index.longest(second)
    assert hit.tokens == 20 and resume_all(engines, "b", "a", hit.tokens)
    reused = turn(engines, "b", second, 20, 4)
    fresh = turn(chain(engine, 1), "b", second, 0, 4)
    assert reused[0] == fresh[0]
    for a, b in zip(reused[1], fresh[1]):
        assert np.allclose(a, b, atol=regrouped_atol(engine), rtol=0)
