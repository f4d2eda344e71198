"""Sampled speculative verification keeps the target model's output distribution exactly.

The model is a bigram table over a small vocabulary (the logits of a row depend on the previous token only), so
the exact distribution of the first two generated tokens is known: p(t1) p(t2 | t1), with p the target's
distribution after temperature, top-k and top-p (computed here from their definitions, independently of
shards/decoding/sampling.py). Many seeded generations with speculation are compared with it by a chi-square
goodness-of-fit test. Seeds are fixed, so the test is deterministic in CI; ALPHA is the chance that a correct rule
fails for an arbitrary choice of seeds. Wrong rules fail the same test, so it has power.
"""

from statistics import NormalDist

import numpy as np
import pytest

from shards.decoding.sampling import SampleResult, SamplerState, SamplingParams, sample_one, sample_rows
from shards.decoding.speculation import verify, verify_blocks

V = 8
RUNS = 3000
ALPHA = 1e-4  # false-alarm rate of each chi-square test
TABLE = np.random.default_rng(7).normal(0, 1.5, size=(V, V)).astype(np.float32)  # logits after token i: TABLE[i]
START = 0

PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.9),
]


def target(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution a token is sampled from, by definition: softmax(logits / T), keep the top_k most likely
    (ties to the lower id), then the shortest most-likely-first prefix whose mass reaches top_p of what is left."""
    scaled = row.astype(np.float64) / p.temperature
    probs = np.exp(scaled - scaled.max())
    order = sorted(range(len(row)), key=lambda t: (-scaled[t], t))
    if p.top_k:
        order = order[: p.top_k]
    if p.top_p < 1:
        mass = np.cumsum(probs[order])
        order = order[: int(np.argmax(mass >= p.top_p * mass[-1])) + 1]
    out = np.zeros(len(row))
    out[order] = probs[order]
    return out / out.sum()


def exact_pairs(p: SamplingParams) -> np.ndarray:
    """[V, V]: the probability that generation starts with (t1, t2)."""
    first = target(TABLE[START], p)
    return first[:, None] * np.stack([target(TABLE[t], p) for t in range(V)])


def chi_square_critical(df: int, alpha: float) -> float:
    """The chi-square quantile 1 - alpha (Wilson-Hilferty; within a few percent for df >= 3)."""
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def fits(counts: np.ndarray, probs: np.ndarray, alpha: float = ALPHA) -> tuple[bool, float, float]:
    """Chi-square goodness of fit; cells expected fewer than 5 times are pooled into one."""
    counts, expected = counts.ravel(), probs.ravel() * counts.sum()
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if (counts[expected == 0] > 0).any():
        return False, float("inf"), 0.0  # a token that cannot be sampled was
    keep = expected > 0
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    critical = chi_square_critical(int(keep.sum()) - 1, alpha)
    return stat <= critical, stat, critical


def drafts_for(run: int, p: SamplingParams) -> tuple[int, int]:
    """Drafts that are sometimes right and sometimes wrong (some outside the top-k/top-p set altogether)."""
    rng = np.random.default_rng(10_000 + run)
    d1 = int(np.argmax(TABLE[START])) if rng.random() < 0.5 else int(rng.integers(V))
    d2 = int(np.argmax(TABLE[d1])) if rng.random() < 0.5 else int(rng.integers(V))
    return d1, d2


def speculative_pairs(p: SamplingParams, rule=None) -> np.ndarray:
    """Counts of (t1, t2) over RUNS seeded generations that propose two drafts, verify them in one block (all runs
    at once through verify_blocks), and sample plainly whatever the block did not give."""
    drafts = [drafts_for(run, p) for run in range(RUNS)]
    states = [SamplerState.from_seed(run) for run in range(RUNS)]
    logits = np.concatenate([TABLE[[START, d1, d2]] for d1, d2 in drafts])
    if rule is None:
        blocks = verify_blocks(logits, drafts, [p] * RUNS, states)
    else:
        blocks = [rule(logits[3 * r : 3 * r + 3], drafts[r], p, states[r]) for r in range(RUNS)]
    firsts = [[r.token for r in block] for block in blocks]
    short = [run for run in range(RUNS) if len(firsts[run]) < 2]  # a rejected first draft: sample t2 plainly
    rows = TABLE[[firsts[run][0] for run in short]]
    for run, r in zip(short, sample_rows(rows, [p] * len(short), [states[run] for run in short])):
        firsts[run].append(r.token)
    counts = np.zeros((V, V), dtype=np.int64)
    np.add.at(counts, tuple(np.array([tokens[:2] for tokens in firsts]).T), 1)
    return counts


def plain_pairs(p: SamplingParams) -> np.ndarray:
    states = [SamplerState.from_seed(run) for run in range(RUNS)]
    t1 = [r.token for r in sample_rows(TABLE[[START] * RUNS], [p] * RUNS, states)]
    t2 = [r.token for r in sample_rows(TABLE[t1], [p] * RUNS, states)]
    counts = np.zeros((V, V), dtype=np.int64)
    np.add.at(counts, (t1, t2), 1)
    return counts


@pytest.mark.parametrize("p", PARAMS, ids=["t1", "t0.7-k4", "t1.3-p0.8", "t0.9-k6-p0.9"])
def test_the_first_two_tokens_are_distributed_as_without_speculation(p):
    ok, stat, critical = fits(plain_pairs(p), exact_pairs(p))
    assert ok, f"the reference itself: non-speculative sampling gives chi2 {stat:.1f} > {critical:.1f}"
    counts = speculative_pairs(p)
    ok, stat, critical = fits(counts, exact_pairs(p))
    assert ok, f"chi2 {stat:.1f} > {critical:.1f}"
    ok, stat, critical = fits(counts.sum(axis=1), target(TABLE[START], p))
    assert ok, f"first token alone: chi2 {stat:.1f} > {critical:.1f}"


def always_accept(logits, drafts, p, state):
    """Wrong: trusts every draft, then samples the bonus token."""
    return [SampleResult(d) for d in drafts] + [sample_one(logits[len(drafts)], p, state)]


def accept_then_resample_with_the_draft(logits, drafts, p, state):
    """Wrong, subtly: accepts d with probability p(d), but on rejection samples from p without removing d."""
    out = []
    for i, d in enumerate(drafts):
        if state.rng.random() < target(logits[i], p)[d]:
            out.append(SampleResult(d))
            continue
        out.append(sample_one(logits[i], p, state))
        return out
    return out + [sample_one(logits[len(drafts)], p, state)]


def textbook_rule(logits, drafts, p, state):
    """Right, with other draws: accept d with probability p(d) (one uniform); on rejection a second uniform samples
    p with d removed, renormalised."""
    out = []
    for i, d in enumerate(drafts):
        probs = target(logits[i], p)
        if state.rng.random() < probs[d]:
            out.append(SampleResult(d))
            continue
        probs[d] = 0
        cdf = np.cumsum(probs / probs.sum())
        out.append(SampleResult(int(min(np.searchsorted(cdf, state.rng.random(), side="right"), V - 1))))
        return out
    return out + [sample_one(logits[len(drafts)], p, state)]


def test_the_textbook_rule_with_independent_draws_passes_the_same_test():
    p = PARAMS[3]
    ok, stat, critical = fits(speculative_pairs(p, textbook_rule), exact_pairs(p))
    assert ok, f"chi2 {stat:.1f} > {critical:.1f}"


@pytest.mark.parametrize("rule", [always_accept, accept_then_resample_with_the_draft])
def test_wrong_rules_fail_the_same_test(rule):
    p = PARAMS[3]
    ok, stat, critical = fits(speculative_pairs(p, rule), exact_pairs(p))
    assert not ok, f"a wrong rule passed: chi2 {stat:.1f} <= {critical:.1f}"


@pytest.mark.parametrize("p", PARAMS, ids=["t1", "t0.7-k4", "t1.3-p0.8", "t0.9-k6-p0.9"])
def test_a_seed_gives_the_same_tokens_with_and_without_speculation_and_leaves_its_stream_in_the_same_place(p):
    """Stronger than equal distributions: the verifier draws exactly one uniform per emitted token and samples
    each row as sample_rows does, so a seeded request's tokens do not depend on the drafts (and a replay's
    SamplerState.from_seed(seed, skip=tokens sampled) continues the same stream)."""
    for run in range(200):
        d1, d2 = drafts_for(run, p)
        spec = SamplerState.from_seed(run)
        tokens = [r.token for r in verify(TABLE[[START, d1, d2]], (d1, d2), p, spec)]
        plain = SamplerState.from_seed(run)
        expected = [sample_one(TABLE[START], p, plain).token]
        while len(expected) < len(tokens):
            expected.append(sample_one(TABLE[expected[-1]], p, plain).token)
        assert tokens == expected
        assert spec.snapshot() == plain.snapshot() == SamplerState.from_seed(run, skip=len(tokens)).snapshot()


def test_a_batched_row_sampler_can_be_plugged_in():
    calls = []

    def sampler(rows, params, states):
        calls.append(len(rows))
        return sample_rows(rows, params, states)

    drafts = [(1, 2), (3,), ()]
    logits = np.random.default_rng(0).normal(size=(6, V)).astype(np.float32)
    params = [SamplingParams(seed=s) for s in range(3)]
    verify_blocks(logits, drafts, params, [SamplerState.from_seed(s) for s in range(3)], sample=sampler)
    assert calls[0] == 3 and len(calls) <= 3  # one call per position, all live requests together
