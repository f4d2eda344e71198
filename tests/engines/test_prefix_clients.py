"""A prefix cache that survives a second client: a request that shares only part of a retained prefix starts from
a copy of that part, and the retained cache stays, whole, for the conversation it belongs to. Exact on every engine
that copies (numpy and ggml, one shard and a chain of three): each request's outputs equal those of computing
every position."""

from __future__ import annotations

import numpy as np
import pytest

from shards.engines.retained import resume_all
from tests.engines.test_prefix_reuse import chain, turn
from tests.support.tolerance import regrouped_atol

ENGINES = ["numpy", "ggml"]


@pytest.mark.parametrize("nodes", [1, 3])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_side_request_copies_a_shared_preamble_and_the_conversation_keeps_its_whole_cache(engine, nodes):
    rng = np.random.default_rng(7)
    preamble, first, side_tail = rng.integers(0, 256, 12), rng.integers(0, 256, 20), rng.integers(0, 256, 9)
    conversation = np.concatenate([preamble, first])
    side = np.concatenate([preamble, side_tail])
    engines = chain(engine, nodes)

    tokens, _ = turn(engines, "turn1", conversation, 0, 4)
    held = np.concatenate([conversation, tokens[:-1]])  # what the cache holds: every position fed
    for e in engines:
        e.retain("turn1")

    # a second client shares only the preamble: it starts from a copy, the conversation's cache stays whole
    assert resume_all(engines, "side", "turn1", len(preamble))
    side_tokens, side_logits = turn(engines, "side", side, len(preamble), 4)
    for e in engines:
        assert "turn1" in e.retained and e.retained.caches["turn1"].length == len(held)
        assert e.retained.copies == 1
        e.release("side")

    # the conversation's next turn resumes from all of it, and takes it over
    second = np.concatenate([held, [tokens[-1]], rng.integers(0, 256, 6)])
    assert resume_all(engines, "turn2", "turn1", len(held))
    turn2_tokens, turn2_logits = turn(engines, "turn2", second, len(held), 4)
    assert all("turn1" not in e.retained for e in engines)

    fresh = chain(engine, nodes)
    want_side, want_side_logits = turn(fresh, "a", side, 0, 4)
    want_turn2, want_turn2_logits = turn(fresh, "b", second, 0, 4)
    atol = regrouped_atol(engine)
    assert side_tokens == want_side and turn2_tokens == want_turn2
    for got, want in zip(side_logits + turn2_logits, want_side_logits + want_turn2_logits):
        np.testing.assert_allclose(got, want, atol=atol, rtol=0)
