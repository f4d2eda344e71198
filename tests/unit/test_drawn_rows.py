"""A top-k row drawn from its best logits (shards/engines/picks.py `Draw`, `best_of`; shards/decoding/sampling.py
`sample_best`): where the candidates are taken, the draw is the sampler's draw over the whole row, bit for bit and
with the same one uniform; where a left-out token could reach the top k, or the device's claim fails a check, they
are not taken and the row is sampled from its logits. So is a top-k or greedy row whose bias and penalties can only
lower logits: applied to the candidates, they give the whole row's token, and its window grows the same."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.decoding.sampling import SamplerState, SamplingParams, sample_best, sample_one
from shards.engines.picks import BEST, Best, Draw, Pick, best_of, host_pick

VOCAB = 2048


def device_claim(row: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, float, float]:
    """What an honest device hands back for a row: its BEST best ids (in no order), their values, the lowest of
    them, how many of the row's values lie above it, and the row's sum."""
    ids = np.argpartition(row, len(row) - BEST)[len(row) - BEST :]
    ids = np.random.default_rng(0).permutation(ids)  # ggml's top-k has no order
    low = float(row[ids].min())
    return ids, row[ids], low, float(np.count_nonzero(row > low)), float(row.sum(dtype=np.float32))


def candidates(row: np.ndarray, draw: Draw) -> Best | None:
    ids, values, low, above, total = device_claim(row)
    return best_of(ids, values, len(row), low, above, total, draw)


def both(row: np.ndarray, params: SamplingParams, seed: int, steps: int = 3) -> tuple[list[int], list[int] | None]:
    """`steps` seeded draws over the whole row and, where the candidates are taken, from them."""
    draw = Draw.of(params)
    best = candidates(row, draw)
    whole, state = [], SamplerState.from_seed(seed)
    for _ in range(steps):
        whole.append(sample_one(row, params, state).token)
    if best is None:
        return whole, None
    state = SamplerState.from_seed(seed)
    return whole, [sample_best(best.ids, best.values, params, state).token for _ in range(steps)]


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    temperature=st.sampled_from([0.05, 0.3, 0.7, 0.8, 1.0, 1.3, 3.0]),
    top_k=st.integers(2, BEST - 1),
    top_p=st.sampled_from([1.0, 0.95, 0.9, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    grid=st.sampled_from([0.0, 0.5, 0.125]),
    scale=st.sampled_from([1.0, 4.0, 12.0]),
)
def test_a_row_drawn_from_its_candidates_draws_what_the_whole_row_draws(
    seed, temperature, top_k, top_p, min_p, grid, scale
):
    rng = np.random.default_rng(seed)
    row = (rng.standard_normal(VOCAB) * scale).astype(np.float32)
    if grid:  # values on a grid: ties everywhere, at the k-th place too
        row = (np.round(row / grid) * grid).astype(np.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    whole, drawn = both(row, params, seed)
    if drawn is not None:
        assert drawn == whole


def both_processed(row: np.ndarray, params: SamplingParams, seed: int, steps: int = 4):
    """`steps` seeded tokens over the whole row and, while each step's candidates are taken (after its bias and its
    penalties over the window the steps before grew), from them; None where a step's were not taken."""
    whole, state = [], SamplerState.from_seed(seed)
    for _ in range(steps):
        whole.append(sample_one(row, params, state).token)
    drawn, state = [], SamplerState.from_seed(seed)
    for _ in range(steps):
        draw = Draw.of(params, tuple(state.window(params)) if params.penalized else ())
        best = None if draw is None else candidates(row, draw)  # (None: a plain greedy row, picked by its argmax)
        if best is None:
            return whole, None
        drawn.append(sample_best(best.ids, best.values, params, state).token)
    return whole, drawn


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    temperature=st.sampled_from([0.0, 0.3, 0.8, 1.0, 2.0]),
    top_k=st.integers(2, BEST - 1),
    repetition=st.sampled_from([1.0, 1.1, 1.5, 10.0]),
    frequency=st.sampled_from([0.0, 0.25, 2.0]),
    presence=st.sampled_from([0.0, 0.5, 2.0]),
    banned=st.integers(0, 5),
    grid=st.sampled_from([0.0, 0.5]),
)
def test_a_row_whose_bias_and_penalties_only_lower_logits_draws_what_the_whole_row_draws(
    seed, temperature, top_k, repetition, frequency, presence, banned, grid
):
    """Greedy and top-k rows; the best tokens in the window (the prompt's tail: each is penalized, some fall under
    others) and some biased down to -100 or by less."""
    rng = np.random.default_rng(seed)
    row = (rng.standard_normal(VOCAB) * 4).astype(np.float32)
    if grid:
        row = (np.round(row / grid) * grid).astype(np.float32)
    best = np.argsort(row)[::-1]
    bias = tuple(sorted((int(t), -100.0 if i % 2 else -0.75) for i, t in enumerate(best[3 : 3 + banned])))
    context = tuple(int(t) for t in rng.choice(best[:60], 30))
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        repetition_penalty=repetition,
        frequency_penalty=frequency,
        presence_penalty=presence,
        logit_bias=bias,
        penalty_context=context,
    )
    whole, drawn = both_processed(row, params, seed)
    if drawn is not None:
        assert drawn == whole


def test_a_penalized_row_is_taken_and_its_window_grows_as_the_whole_rows():
    rng = np.random.default_rng(4)
    taken = 0
    for seed in range(20):
        row = (rng.standard_normal(VOCAB) * 3).astype(np.float32)
        context = tuple(int(t) for t in np.argsort(row)[::-1][:10])  # the ten best, each penalized
        for temperature in (0.0, 0.8):
            params = SamplingParams(
                temperature=temperature, top_k=40, top_p=0.9, repetition_penalty=1.1, penalty_context=context
            )
            whole, drawn = both_processed(row, params, seed, steps=6)
            taken += drawn is not None
            assert drawn in (None, whole)
    assert taken == 40


def test_a_penalty_that_lifts_a_left_out_token_is_not_a_draw():
    for params in (
        SamplingParams(temperature=0.8, top_k=40, repetition_penalty=0.9),  # lifts a negative logit
        SamplingParams(temperature=0.8, top_k=40, presence_penalty=-0.5),
        SamplingParams(temperature=0.0, frequency_penalty=-0.1),
        SamplingParams(temperature=0.0, logit_bias=((3, 0.5),)),
    ):
        assert Draw.of(params, (3, 3)) is None, params
    with pytest.raises(ValueError):
        Draw(40, 0.8, SamplingParams(temperature=0.8, top_k=40, presence_penalty=-0.5))


def test_the_candidates_are_taken_for_an_ordinary_row_and_hold_the_same_draws():
    rng = np.random.default_rng(1)
    for seed in range(40):
        row = (rng.standard_normal(VOCAB) * 3).astype(np.float32)
        params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=seed)  # Ollama's defaults
        whole, drawn = both(row, params, seed, steps=5)
        assert drawn == whole  # taken (not None), and the same tokens


def test_a_tie_at_the_kth_place_with_a_left_out_token_is_not_taken():
    row = np.linspace(-4, 0, VOCAB, dtype=np.float32)
    row[:200] = 1.0  # 200 tokens tied at the top: the top 40 are the lowest ids among them, some left out
    assert candidates(row, Draw(40, 1.0)) is None
    row[:200] = np.arange(200, dtype=np.float32)  # distinct: taken
    assert candidates(row, Draw(40, 1.0)) is not None


def test_a_division_that_rounds_a_left_out_token_up_to_the_kth_is_not_taken():
    row = np.full(VOCAB, -10.0, dtype=np.float32)
    row[:60] = np.arange(60, dtype=np.float32) + 100
    row[60:128] = np.linspace(1.0e-6, 1.001e-6, 68, dtype=np.float32)  # distinct, all above the tokens left out
    row[128:300] = np.float32(0.99e-6)
    assert candidates(row, Draw(70, 1.0)) is not None
    # divided by 3e38 they all round to the same few subnormal numbers: a left-out token ties the 70th best
    assert candidates(row, Draw(70, 3e38)) is None


def test_a_claim_that_fails_a_check_is_not_taken():
    row = (np.random.default_rng(2).standard_normal(VOCAB) * 3).astype(np.float32)
    ids, values, low, above, total = device_claim(row)
    draw = Draw(40, 0.7)
    assert best_of(ids, values, VOCAB, low, above, total, draw) is not None
    order = np.argsort(row)[::-1]
    missing = ids.copy()  # the best id left out, another twice: the count above the lowest gives it away
    missing[missing == order[0]] = order[1]
    assert best_of(missing, row[missing], VOCAB, low, above, total, draw) is None
    twice = np.concatenate([ids[:-1], ids[:1]])
    assert best_of(twice, row[twice], VOCAB, float(row[twice].min()), above, total, draw) is None
    assert best_of(ids, values, VOCAB, low, above, float("nan"), draw) is None  # a NaN in the row
    assert best_of(ids, values, VOCAB, low, above, float("inf"), draw) is None
    assert best_of(ids, values, VOCAB, low + 1, above, total, draw) is None  # a wrong lowest
    assert best_of(ids, values, VOCAB, low, above - 1, total, draw) is None
    assert best_of(ids, values, int(ids.max()), low, above, total, draw) is None  # an id past the vocabulary
    assert best_of(ids[:40], values[:40], VOCAB, float(values[:40].min()), 39.0, total, draw) is None  # k of k


def test_a_top_k_row_or_a_processed_greedy_row_is_drawn_from_candidates():
    assert Draw.of(SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05)) == Draw(40, 0.8)
    penalized = SamplingParams(temperature=0.8, top_k=40, presence_penalty=0.5)
    assert Draw.of(penalized, (7, 9)) == Draw(40, 0.8, penalized, (7, 9))
    banned = SamplingParams(temperature=0.0, logit_bias=((3, -100.0),))
    assert Draw.of(banned, (7, 9)) == Draw(1, 1.0, banned, ())  # greedy; nothing penalized: no window
    for params in (
        SamplingParams(temperature=0.0, top_k=40),  # plain greedy: picked by its argmax
        SamplingParams(temperature=0.8, top_k=1),  # the same
        SamplingParams(temperature=0.8),  # no top-k: the whole row's mass
        SamplingParams(temperature=0.8, top_k=BEST),  # more than the candidates can hold
        SamplingParams(temperature=0.8, top_k=40, top_logprobs=2),
        SamplingParams(temperature=0.8, top_k=40, logit_bias=((3, 1.0),)),  # lifts a token
    ):
        assert Draw.of(params) is None, params
    with pytest.raises(ValueError):
        sample_best(np.arange(50), np.zeros(50, np.float32), SamplingParams(temperature=0.8), SamplerState())


def test_a_host_pick_hands_a_drawn_row_back_as_its_logits():
    row = np.random.default_rng(3).standard_normal(VOCAB).astype(np.float32)
    pick = host_pick(row, Draw(40, 0.8))
    assert pick.tokens is None and pick.best is None and np.array_equal(pick.logits, row[None])


def test_candidates_are_increasing_distinct_ids_with_finite_values_and_a_pick_holds_one_kind():
    with pytest.raises(ValueError):
        Best(np.array([3, 2]), np.zeros(2, np.float32))
    with pytest.raises(ValueError):
        Best(np.array([1, 2]), np.array([0.0, np.nan], np.float32))
    with pytest.raises(ValueError):
        Draw(BEST, 1.0)
    with pytest.raises(ValueError):
        Draw(40, 0.0)
    best = Best(np.array([1, 2]), np.zeros(2, np.float32))
    with pytest.raises(ValueError):
        Pick(tokens=(1,), best=best)
    assert Pick(best=best).best is best
