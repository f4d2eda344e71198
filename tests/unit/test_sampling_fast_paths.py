"""The sampler's shortcuts change no token: the k best ids are looked for among a prefiltered few (`_best_ids`), a
top-p nucleus among the best 1,024 then 8,192 before the whole row is sorted (`_nucleus`), and a top-k draw computes
probabilities for its survivors only (`_draw`). Specified against the plain definitions: every
id ranked, every probability computed."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.decoding import sampling
from shards.decoding.sampling import SamplerState, SamplingParams, sample_rows

VOCAB = 49152
SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=40, top_p=0.9),  # Ollama's and llama-server's defaults
    dict(temperature=1.0, top_k=40),
    dict(temperature=1.3, top_k=1000),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, top_p=0.5),
    dict(temperature=2.0, top_p=0.999),
    dict(temperature=0.8, min_p=0.05),
    dict(temperature=1.0, top_k=64, min_p=0.1),
    dict(temperature=0.9, top_p=0.95, min_p=0.02),
    dict(temperature=1.0, top_k=2000, top_p=0.8),
]


def ranked(scores: np.ndarray, k: int) -> np.ndarray:
    """The k best ids by the definition: every id sorted by score, best first, ties by id."""
    return np.lexsort((np.arange(len(scores)), -scores))[:k]


def reference_token(row: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    """A draw by the definition: the whole row's probabilities, the filters over ranked ids, the survivors' CDF in
    id order, one uniform."""
    scaled = row / np.float32(p.temperature)
    probs = np.exp(scaled - scaled.max())
    ids = np.arange(len(row))
    if p.top_k:
        ids = ranked(scaled, p.top_k)
    else:
        ids = ranked(scaled, len(row))
    if p.top_p < 1.0:
        mass = np.cumsum(probs[ids], dtype=np.float64)
        total = mass[-1] if p.top_k else probs.sum(dtype=np.float64)
        ids = ids[: min(int(np.searchsorted(mass, p.top_p * total, side="left")), len(ids) - 1) + 1]
    if p.min_p > 0:
        ids = ids[probs[ids] >= np.float32(p.min_p)]
    ids = np.sort(ids)
    cdf = np.cumsum(probs[ids], dtype=np.float64)
    return int(ids[min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(cdf) - 1)])


def rows(kind: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == 0:  # peaked
        return (rng.standard_normal((3, VOCAB)) * 3).astype(np.float32)
    if kind == 1:  # coarse: many ties, at the k-th best too
        return (np.round(rng.standard_normal((3, VOCAB)) * 2) / 2).astype(np.float32)
    if kind == 2:
        return (rng.standard_normal((3, VOCAB)) * 0.3).astype(np.float32)  # flat: a wide nucleus
    return (rng.standard_normal((3, VOCAB)) * 2).astype(np.float32)  # between: nuclei of 1k to 14k ids


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.integers(-4, 4), min_size=1, max_size=3000),
    k=st.integers(1, 3000),
)
def test_the_k_best_ids_are_the_definitions_whatever_the_ties(values, k):
    scores = np.asarray(values, dtype=np.float32) / 2
    k = min(k, len(scores))
    assert sampling._best_ids(scores, k).tolist() == ranked(scores, k).tolist()


def test_the_k_best_of_a_vocabulary_with_ties_at_the_kth_are_the_definitions():
    for kind in range(3):
        for k in (1, 40, 64, 1024, 3000):
            row = rows(kind, k)[0]
            assert sampling._best_ids(row, k).tolist() == ranked(row, k).tolist(), (kind, k)


def test_seeded_draws_are_the_definitions_under_every_filter():
    for si, s in enumerate(SETTINGS):
        for kind in range(4):
            params = [SamplingParams(seed=10 * si + r, **s) for r in range(3)]
            states = [SamplerState.from_seed(p.seed) for p in params]
            refs = [np.random.default_rng(p.seed) for p in params]
            for step in range(3):
                batch = rows(kind, 100 * step + si)
                got = [r.token for r in sample_rows(batch, params, states)]
                want = [reference_token(row, p, rng) for row, p, rng in zip(batch, params, refs)]
                assert got == want, (s, kind, step)
