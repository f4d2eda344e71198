"""Hostile text tokenizes in linear time: emoji, ZWJ sequences, NUL and bidi controls go at a rate comparable to
plain text of the same length, and a long run of one character (one unbroken "word") costs ten times as much at
ten times the length, not a hundred (BPE's merge loop over one long word is where a tokenizer goes quadratic).
Times are CPU seconds of this process, the best of a few runs, compared within one test run."""

from __future__ import annotations

import random
import time

import pytest

from shards.formats.packaged import resolve_model
from shards.formats.tokenizer import Tokenizer

HOSTILE = ["\U0001f600", "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\x00", "\u202e", "\u2066", "\u200f", "\ufeff"]
HOSTILE += ["e\u0301", "\U0001f1fa\U0001f1f8", "\u0000\u202d"]
PLAIN = "The quick brown fox jumps over the lazy dog, and then it naps. "


@pytest.fixture(scope="module", params=["smollm2 gguf", "gemma3 folder"])
def tok(request) -> Tokenizer:
    return Tokenizer.load(
        resolve_model("smollm2")[0] if request.param == "smollm2 gguf" else "tests/fixtures/gemma/gemma3"
    )


def cpu(tok: Tokenizer, text: str, runs: int = 3) -> tuple[float, int]:
    """(best CPU seconds, tokens) of tokenizing `text`."""
    best, n = float("inf"), 0
    for _ in range(runs):
        start = time.process_time()
        n = len(tok.encode(text, add_special_tokens=False))
        best = min(best, time.process_time() - start)
    return max(best, 1e-4), n


def test_hostile_text_tokenizes_at_least_a_fifth_as_fast_as_plain_text(tok):
    rng = random.Random(0)
    hostile = "".join(rng.choice(HOSTILE) for _ in range(20_000))[:40_000]
    plain = (PLAIN * (len(hostile) // len(PLAIN) + 1))[: len(hostile)]
    (t_hostile, n_hostile), (t_plain, n_plain) = cpu(tok, hostile), cpu(tok, plain)
    assert n_hostile >= len(hostile) // 4  # it really is many tokens
    assert n_hostile / t_hostile >= 0.2 * (n_plain / t_plain), (n_hostile, t_hostile, n_plain, t_plain)


@pytest.mark.parametrize("char", ["a", " ", "\x00", "\U0001f600", "\u202e", "7"])
def test_100_kb_of_one_character_costs_linear_not_quadratic_time_over_10_kb(tok, char):
    small, n_small = cpu(tok, char * 10_000)
    big, n_big = cpu(tok, char * 100_000)
    assert n_big >= 9 * n_small
    assert big <= 30 * max(small, 2e-3), (char, small, big)  # linear: ~10x; quadratic: ~100x
