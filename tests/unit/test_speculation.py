"""Speculative decoding's pure pieces: prompt lookup, the adaptive draft length, greedy and constrained verification.

The sampled rule's statistical tests are in test_speculation_sampling.py."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.decoding.grammar import Constraint, Matcher, grammar_tokenizer, json_object_grammar
from shards.decoding.sampling import SamplerState, SamplingParams, sample_one
from shards.decoding.speculation import DraftLength, PromptLookup, verify, verify_blocks
from shards.formats.packaged import resolve_model
from shards.formats.tokenizer import Tokenizer

# ---------------------------------------------------------------- prompt lookup


def brute_force_lookup(tokens, k, max_ngram, min_ngram):
    """The definition: the longest suffix (max_ngram..min_ngram) that occurred earlier with a token after it; its
    most recent such occurrence; up to k of the tokens that followed it."""
    tokens = list(tokens)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for s in range(len(tokens) - n - 1, -1, -1):
            if tokens[s : s + n] == suffix:
                return tuple(tokens[s + n : s + n + k])
    return ()


def test_a_repeated_passage_proposes_what_followed_it():
    code = [10, 11, 12, 13, 14, 15, 16, 17]
    tokens = [1, 2] + code + [3, 4] + code[:3]
    assert PromptLookup().propose("r", tokens, 4) == (13, 14, 15, 16)


def test_proposals_respect_k_and_the_end_of_the_text():
    tokens = [5, 6, 7, 8, 9, 5, 6]
    lookup = PromptLookup(min_ngram=2)
    assert lookup.propose("r", tokens, 2) == (7, 8)
    assert lookup.propose("r", tokens, 0) == ()
    assert lookup.propose("r", tokens, 50) == (7, 8, 9, 5, 6)  # what follows, up to the end of the text


def test_no_match_proposes_nothing():
    assert PromptLookup(min_ngram=1).propose("r", list(range(100)), 8) == ()
    assert PromptLookup().propose("r", [], 8) == ()
    assert PromptLookup().propose("r", [7], 8) == ()


def test_the_longest_ngram_wins_over_a_more_recent_shorter_match():
    # (2, 3) occurs twice; the 3-gram (1, 2, 3) only at the start: its continuation wins
    tokens = [1, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3]
    assert PromptLookup(max_ngram=3, min_ngram=2).propose("r", tokens, 1) == (40,)
    assert PromptLookup(max_ngram=2, min_ngram=2).propose("r", tokens, 1) == (50,)  # most recent 2-gram


def test_requests_are_indexed_separately_and_release_frees():
    lookup = PromptLookup()
    assert lookup.propose("a", [1, 2, 3, 1, 2], 1) == (3,)
    assert lookup.propose("b", [1, 2, 4, 1, 2], 1) == (4,)
    assert len(lookup) == 2
    lookup.release("a")
    lookup.release("a")  # idempotent
    lookup.release("unknown")
    assert len(lookup) == 1


def test_at_most_max_requests_indexes_are_kept_and_an_evicted_one_is_rebuilt():
    lookup = PromptLookup(max_requests=2)
    for r in "abc":
        lookup.propose(r, [1, 2, 3, 1, 2], 1)
    assert len(lookup) == 2
    assert lookup.propose("a", [1, 2, 3, 1, 2], 1) == (3,)  # evicted, re-indexed, same answer


def test_at_most_max_tokens_are_indexed_in_all_but_the_request_asked_for_always_is():
    lookup = PromptLookup(max_tokens=15)
    lookup.propose("a", [1, 2, 3, 1, 2] * 2, 1)
    lookup.propose("b", [4, 5, 6, 4, 5] * 2, 1)  # 20 tokens: "a" goes
    assert len(lookup) == 1 and lookup.indexed_tokens == 10
    assert lookup.propose("c", list(range(30)) + [0, 1], 2) == (2, 3)  # alone beyond the bound: kept, answered
    assert len(lookup) == 1 and lookup.indexed_tokens == 32
    lookup.release("c")
    assert lookup.indexed_tokens == 0


def test_text_that_does_not_extend_the_indexed_text_is_reindexed():
    lookup = PromptLookup()
    assert lookup.propose("r", [1, 2, 3, 1, 2], 1) == (3,)
    assert lookup.propose("r", [1, 2, 4, 1, 2], 1) == (4,)  # a replay with other tokens: not the old index
    assert lookup.indexed_tokens == 5


@pytest.mark.parametrize(
    "bad", [dict(min_ngram=0), dict(max_ngram=1, min_ngram=2), dict(max_requests=0), dict(max_tokens=0)]
)
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        PromptLookup(**bad)


@settings(max_examples=150, deadline=None)
@given(
    text=st.lists(st.integers(0, 4), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=8),
    k=st.integers(0, 6),
    ngrams=st.sampled_from([(1, 1), (2, 1), (3, 2), (4, 2), (5, 3)]),
)
def test_the_incremental_index_answers_like_the_brute_force_definition(text, cuts, k, ngrams):
    max_ngram, min_ngram = ngrams
    lookup = PromptLookup(max_ngram, min_ngram)
    # growing prefixes (the usual case), then a shorter or divergent text (a replay), then growing again
    for cut in sorted(c for c in cuts if c <= len(text)) + [len(text)]:
        assert lookup.propose("r", text[:cut], k) == brute_force_lookup(text[:cut], k, max_ngram, min_ngram)
        assert lookup.indexed_tokens == cut
    other = text[::-1]
    assert lookup.propose("r", other, k) == brute_force_lookup(other, k, max_ngram, min_ngram)


# ---------------------------------------------------------------- adaptive draft length


def run(length: DraftLength, accept_fraction: float, steps: int) -> list[int]:
    proposed = []
    for _ in range(steps):
        k = length.next()
        proposed.append(k)
        length.update(k, int(k * accept_fraction))
    return proposed


def test_the_draft_length_grows_with_acceptance_up_to_the_maximum():
    assert run(DraftLength(6), 1.0, 8) == [2, 3, 4, 5, 6, 6, 6, 6]


def test_a_partial_acceptance_shrinks_it_to_one_more_than_accepted():
    length = DraftLength(8)
    run(length, 1.0, 6)
    length.update(length.next(), 2)
    assert length.next() == 3


def test_it_pauses_after_repeated_failures_and_retries_after_a_growing_back_off():
    length = DraftLength(8, patience=3, backoff=4, max_backoff=8)
    proposed = run(length, 0.0, 3 + 4 + 1 + 8 + 1 + 8)
    assert proposed == [2, 1, 1] + [0] * 4 + [1] + [0] * 8 + [1] + [0] * 8  # back-off doubles, up to max_backoff


def test_an_acceptance_after_a_pause_ends_the_back_off():
    length = DraftLength(8, patience=2, backoff=2)
    run(length, 0.0, 2 + 2)  # two failures, a pause of 2
    assert length.next() == 1
    length.update(1, 1)
    assert [length.next() for _ in range(2)] == [2, 2]  # no pause: growing again
    length.update(2, 0)
    length.update(1, 0)
    assert [length.next() for _ in range(3)] == [0, 0, 1]  # the first back-off again, not a doubled one


def test_zero_max_tokens_never_proposes_and_nothing_tried_changes_nothing():
    assert run(DraftLength(0), 1.0, 5) == [0] * 5
    length = DraftLength(4)
    length.update(0, 0)
    assert length.next() == 2


@pytest.mark.parametrize("proposed, accepted", [(2, 3), (-1, 0), (1, -1)])
def test_impossible_updates_are_refused(proposed, accepted):
    with pytest.raises(ValueError):
        DraftLength(4).update(proposed, accepted)


# ---------------------------------------------------------------- greedy verification

GREEDY = SamplingParams(temperature=0.0)


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(0, 6),
    matching=st.integers(0, 6),
    vocab=st.integers(2, 40),
    seed=st.integers(0, 2**32 - 1),
)
def test_greedy_accepts_the_longest_prefix_equal_to_the_argmax_then_the_argmax_after_it(k, matching, vocab, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(k + 1, vocab)).astype(np.float32)
    best = logits.argmax(axis=1)
    # drafts that follow the argmax for `matching` positions and then (maybe) stray
    drafts = tuple(int(best[i]) if i < matching else int(rng.integers(vocab)) for i in range(k))
    accepted = 0
    while accepted < k and drafts[accepted] == best[accepted]:
        accepted += 1
    tokens = [r.token for r in verify(logits, drafts, GREEDY, SamplerState.from_seed(0))]
    assert tokens == list(drafts[:accepted]) + [int(best[accepted])]


def test_greedy_ties_go_to_the_lowest_id_as_in_non_speculative_sampling():
    logits = np.zeros((2, 5), dtype=np.float32)
    assert [r.token for r in verify(logits, (3,), GREEDY, SamplerState())] == [0]


def test_greedy_draws_nothing_from_the_request_stream():
    state = SamplerState.from_seed(9)
    before = state.snapshot()
    verify(np.eye(4, dtype=np.float32), (0, 1, 2), GREEDY, state)
    assert state.snapshot() == before


def test_logprobs_are_reported_like_non_speculative_sampling():
    logits = np.random.default_rng(1).normal(size=(3, 30)).astype(np.float32)
    drafts = tuple(int(t) for t in logits.argmax(axis=1)[:2])
    results = verify(logits, drafts, GREEDY, SamplerState(), top_logprobs=3)
    assert len(results) == 3
    for row, r in zip(logits, results):
        logz = np.log(np.exp(row.astype(np.float64) - row.max()).sum()) + row.max()
        assert r.logprob == pytest.approx(row[r.token] - logz, abs=1e-5)
        assert [t for t, _ in r.top_logprobs] == list(np.argsort(-row, kind="stable")[:3])


def test_blocks_of_several_requests_verify_as_each_alone():
    rng = np.random.default_rng(2)
    params = [GREEDY, SamplingParams(temperature=0.8, seed=1), SamplingParams(top_k=5, seed=2), GREEDY]
    sizes = [3, 1, 5, 4]
    logits = rng.normal(size=(sum(sizes), 12)).astype(np.float32)
    drafts, at = [], 0
    for n in sizes:  # drafts that follow the argmax (often accepted), the last one wrong
        best = logits[at : at + n].argmax(axis=1)
        drafts.append(tuple(int(t) for t in best[: n - 2]) + ((int(best[n - 2]) + 1) % 12,) if n > 1 else ())
        at += n
    together = verify_blocks(logits, drafts, params, [SamplerState.from_seed(p.seed) for p in params])
    at = 0
    for d, p, n, got in zip(drafts, params, sizes, together):
        assert got == verify(logits[at : at + n], d, p, SamplerState.from_seed(p.seed))
        at += n


@settings(max_examples=60, deadline=None)
@given(
    blocks=st.lists(
        st.tuples(st.integers(0, 4), st.sampled_from([0.0, 0.7, 1.0]), st.integers(0, 8), st.integers(0, 99)),
        min_size=1,
        max_size=5,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_mix_of_blocks_verifies_together_as_each_alone(blocks, seed):
    rng = np.random.default_rng(seed)
    vocab = 6  # small: drafts are often right
    params = [SamplingParams(temperature=t, top_k=k, seed=s) for _, t, k, s in blocks]
    logits = rng.normal(0, 2, size=(sum(n + 1 for n, *_ in blocks), vocab)).astype(np.float32)
    drafts = [tuple(int(x) for x in rng.integers(0, vocab, n)) for n, *_ in blocks]
    together = verify_blocks(logits, drafts, params, [SamplerState.from_seed(p.seed) for p in params])
    at = 0
    for d, p, got in zip(drafts, params, together):
        assert got == verify(logits[at : at + len(d) + 1], d, p, SamplerState.from_seed(p.seed))
        assert 1 <= len(got) <= len(d) + 1 and [r.token for r in got[:-1]] == list(d[: len(got) - 1])
        at += len(d) + 1


def test_logits_that_do_not_match_the_drafts_are_refused():
    with pytest.raises(ValueError, match="rows"):
        verify(np.zeros((2, 5), dtype=np.float32), (1, 2), GREEDY, SamplerState())


# ---------------------------------------------------------------- grammar-constrained verification


def test_a_constrained_request_verifies_to_the_tokens_of_plain_constrained_sampling():
    """The matcher masks each row before it is sampled and takes each emitted token, as the sampling batcher does;
    so with drafts that are sometimes right, sometimes wrong and sometimes not allowed by the grammar, a seeded
    request emits exactly what it emits without speculation."""
    tok = Tokenizer.load(resolve_model("smollm2")[0])
    gt = grammar_tokenizer(tok)
    params = SamplingParams(temperature=1.0, top_k=40, seed=3, constraint=Constraint(json_object_grammar()))
    logits = np.random.default_rng(5).normal(0, 3, size=(40, tok.vocab_size)).astype(np.float32)  # by position

    plain, state = [], SamplerState.from_seed(3)
    state.matcher = Matcher(gt, params.constraint)
    for row in logits[:30]:
        token = sample_one(state.matcher.apply(row), params, state).token
        state.matcher.advance(token)
        plain.append(token)

    spec, state = [], SamplerState.from_seed(3)
    state.matcher = Matcher(gt, params.constraint)
    rng = np.random.default_rng(0)
    while len(spec) < 30:
        ahead = plain[len(spec) : len(spec) + 3]
        drafts = tuple(t if rng.random() < 0.7 else int(rng.integers(tok.vocab_size)) for t in ahead)
        block = verify(logits[len(spec) : len(spec) + len(drafts) + 1], drafts, params, state)
        spec.extend(r.token for r in block)
    assert spec[:30] == plain


def test_a_constrained_request_without_its_matcher_is_refused():
    params = SamplingParams(constraint=Constraint(json_object_grammar()))
    with pytest.raises(ValueError, match="matcher"):
        verify(np.zeros((1, 4), dtype=np.float32), (), params, SamplerState())
