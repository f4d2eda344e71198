"""Sampling semantics, and the guarantee the batcher relies on: a row's token never depends on its batch."""

import numpy as np
import pytest

from shards.decoding.sampling import SamplerState, SamplingParams, sample_one, sample_rows

V = 1000


def logits_batch(n, vocab=V, seed=0):
    return np.random.default_rng(seed).normal(0, 3, size=(n, vocab)).astype(np.float32)


def run_alone(rows, params, steps):
    out = []
    for row, p in zip(rows, params):
        state = SamplerState.from_seed(p.seed)
        out.append([sample_one(row, p, state).token for _ in range(steps)])
    return out


def run_batched(rows, params, steps):
    states = [SamplerState.from_seed(p.seed) for p in params]
    out = [[] for _ in params]
    for _ in range(steps):
        for i, r in enumerate(sample_rows(rows, params, states)):
            out[i].append(r.token)
    return out


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.0, top_p=0.9, seed=2),
    SamplingParams(temperature=1.3, top_k=20, seed=3),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.5, seed=4),
    SamplingParams(temperature=1.0, seed=5, top_logprobs=3),
    SamplingParams(temperature=2.0, top_p=0.99, seed=6),
    SamplingParams(temperature=0.5, seed=7),
]


def test_seeded_rows_sample_the_same_alone_or_batched():
    rows = logits_batch(8)
    assert run_batched(rows, MIXED, 20) == run_alone(rows, MIXED, 20)


def test_batch_order_and_neighbours_do_not_matter():
    rows = logits_batch(8)
    perm = [3, 7, 0, 5, 1, 6, 2, 4]
    shuffled = run_batched(rows[perm], [MIXED[i] for i in perm], 10)
    straight = run_batched(rows, MIXED, 10)
    assert [shuffled[perm.index(i)] for i in range(8)] == straight
    # the same request next to completely different rows
    other = logits_batch(8, seed=99)
    other[2] = rows[2]
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(8)]
    params[2] = MIXED[2]
    assert run_batched(other, params, 10)[2] == straight[2]


def test_greedy_is_argmax_and_ties_go_to_the_lower_id():
    row = np.zeros(10, dtype=np.float32)
    row[[3, 7]] = 5.0
    assert sample_one(row, SamplingParams(temperature=0), SamplerState()).token == 3
    assert sample_one(row, SamplingParams(temperature=1.0, top_k=1), SamplerState()).token == 3


def test_top_k_only_samples_the_k_best():
    row = logits_batch(1)[0] / 10  # flat-ish so the cut matters
    best = set(np.argsort(-row)[:5].tolist())
    state = SamplerState.from_seed(0)
    seen = {sample_one(row, SamplingParams(top_k=5, seed=0), state).token for _ in range(300)}
    assert seen == best


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    state = SamplerState.from_seed(1)
    seen = {sample_one(row, SamplingParams(top_p=0.79, seed=1), state).token for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.79, 0.5 + 0.3 crosses it: token 1 is kept, 2 and 3 are not
    seen = {sample_one(row, SamplingParams(top_p=0.81, seed=1), state).token for _ in range(300)}
    assert seen == {0, 1, 2}


def test_top_p_on_a_flat_distribution_falls_back_to_a_full_sort():
    row = np.zeros(5000, dtype=np.float32)  # 1024 preselected tokens hold only ~20% of the mass
    state = SamplerState.from_seed(2)
    seen = {sample_one(row, SamplingParams(top_p=0.5, seed=2), state).token for _ in range(2000)}
    assert max(seen) >= 2000 and max(seen) < 2500  # ties by id: the nucleus is ids [0, 2500)


def test_sampling_follows_the_distribution():
    probs = np.array([0.6, 0.3, 0.1])
    state = SamplerState.from_seed(3)
    draws = [sample_one(np.log(probs), SamplingParams(seed=3), state).token for _ in range(6000)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    assert np.allclose(freq, probs, atol=0.03)


def test_temperature_sharpens():
    row = np.log(np.array([0.6, 0.4], dtype=np.float32))
    state = SamplerState.from_seed(4)
    cold = [sample_one(row, SamplingParams(temperature=0.1, seed=4), state).token for _ in range(500)]
    assert sum(cold) < 10


def test_logprobs_are_log_softmax_of_the_raw_logits():
    row = logits_batch(1)[0]
    r = sample_one(row, SamplingParams(temperature=0, top_logprobs=4), SamplerState())
    logz = np.log(np.exp(row.astype(np.float64)).sum())
    assert r.token == int(np.argmax(row))
    assert r.logprob == pytest.approx(row[r.token] - logz, abs=1e-5)
    assert [t for t, _ in r.top_logprobs] == np.argsort(-row)[:4].tolist()
    assert r.top_logprobs[0][1] == pytest.approx(r.logprob)
    assert sample_one(row, SamplingParams(temperature=0), SamplerState()).logprob is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"temperature": float("nan")},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"top_k": 1.5},
        {"seed": -3},
        {"top_logprobs": 21},
    ],
)
def test_invalid_params_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_mismatched_batch_shapes_are_rejected():
    with pytest.raises(ValueError):
        sample_rows(logits_batch(2), [SamplingParams()], [SamplerState()])
