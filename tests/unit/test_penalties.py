"""Logit bias, repetition penalties and min-p (shards/decoding/penalties.py, shards/decoding/sampling.py): llama.cpp's
formula over a window of the last tokens (the prompt's tail, then the sampled ones), exact alone or in a batch, and
a replay that rebuilds the window from its own prompt continues exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.grpc import wire
from shards.decoding.penalties import MAX_PENALTY_WINDOW, apply, apply_at, lowers_only, with_context
from shards.decoding.sampling import SamplerState, SamplingParams, sample_rows
from shards.decoding.speculation import verify

VOCAB = 32


def reference(row: np.ndarray, p: SamplingParams, window: list[int]) -> np.ndarray:
    """The formula token by token, in float32 scalars (llama.cpp's logit-bias then penalties samplers)."""
    out = row.astype(np.float32).copy()
    for t, b in p.logit_bias:
        out[t] = np.float32(out[t] + np.float32(b))
    for t in set(window):
        c = window.count(t)
        x, rep = out[t], np.float32(p.repetition_penalty)
        x = np.float32(x * rep) if x <= 0 else np.float32(x / rep)
        out[t] = np.float32(x - (np.float32(c) * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty)))
    return out


penalty = st.floats(-2, 2, width=32)
params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    presence_penalty=penalty,
    frequency_penalty=penalty,
    repetition_penalty=st.floats(0.5, 2.0, width=32),
    penalty_last_n=st.integers(1, 16),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100, width=32), max_size=4).map(
        lambda d: tuple(sorted(d.items()))
    ),
)


@settings(max_examples=200, deadline=None)
@given(params, st.lists(st.integers(0, VOCAB - 1), max_size=16), st.integers(0, 2**32 - 1))
def test_a_row_is_biased_then_penalized_by_each_recent_tokens_count_as_llama_cpp_does(p, window, seed):
    row = np.random.default_rng(seed).normal(0, 3, VOCAB).astype(np.float32)
    window = window[-p.penalty_last_n :]
    assert np.array_equal(apply(row, p, window), reference(row, p, window))


@settings(max_examples=200, deadline=None)
@given(
    params,
    st.lists(st.integers(0, VOCAB - 1), max_size=16),
    st.sets(st.integers(0, VOCAB - 1), min_size=1),
    st.integers(0, 2**32 - 1),
)
def test_at_some_ids_the_row_is_what_the_whole_row_is_there(p, window, some, seed):
    """`apply_at`, which a row drawn from its candidates takes (shards/engines/picks.py): bit for bit `apply`'s
    values at those ids, whatever the bias and window name outside them."""
    row = np.random.default_rng(seed).normal(0, 3, VOCAB).astype(np.float32)
    window = window[-p.penalty_last_n :]
    ids = np.array(sorted(some), dtype=np.int64)
    got = apply_at(ids, row[ids], p, window)
    assert np.array_equal(got.view(np.uint32), apply(row, p, window)[ids].view(np.uint32))


@settings(max_examples=200, deadline=None)
@given(params, st.lists(st.integers(0, VOCAB - 1), max_size=16), st.integers(0, 2**32 - 1))
def test_where_a_row_is_said_only_lowered_no_value_rises(p, window, seed):
    row = np.random.default_rng(seed).normal(0, 3, VOCAB).astype(np.float32)
    window = window[-p.penalty_last_n :]
    if lowers_only(p):
        assert (apply(row, p, window) <= row).all()


def test_a_bias_of_minus_100_bans_a_token_and_plus_100_forces_one():
    row = np.arange(VOCAB, dtype=np.float32) / 10  # the last id is the likeliest
    banned = SamplingParams(temperature=0.0, logit_bias=((VOCAB - 1, -100.0),))
    assert sample_rows(row[None], [banned], [SamplerState()])[0].token == VOCAB - 2
    forced = SamplingParams(temperature=1.0, seed=3, logit_bias=((0, 100.0),))
    state = SamplerState.from_seed(3)
    assert {sample_rows(row[None], [forced], [state])[0].token for _ in range(50)} == {0}


def test_greedy_with_a_frequency_penalty_stops_repeating_its_best_token():
    row = np.zeros(VOCAB, dtype=np.float32)
    row[:3] = [3.0, 2.5, 2.0]
    p = with_context(SamplingParams(temperature=0.0, frequency_penalty=1.0, penalty_last_n=4), [7, 7])
    state, tokens = SamplerState(), []
    for _ in range(6):
        tokens.append(sample_rows(row[None], [p], [state])[0].token)
    expected, window = [], [7, 7]
    for _ in range(6):
        scores = reference(row, p, window[-4:])
        expected.append(int(np.argmax(scores)))
        window.append(expected[-1])
    assert tokens == expected == [0, 1, 0, 2, 1, 0]  # unpenalized, greedy picks 0 every time


def test_only_the_last_n_tokens_count():
    row = np.zeros(VOCAB, dtype=np.float32)
    row[5] = 1.0
    p = SamplingParams(temperature=0.0, presence_penalty=2.0, penalty_last_n=3)
    assert sample_rows(row[None], [with_context(p, [5, 1, 2])], [SamplerState()])[0].token != 5  # 5 in the window
    assert sample_rows(row[None], [with_context(p, [5, 1, 2, 3])], [SamplerState()])[0].token == 5  # it left it


def test_a_replay_that_rebuilds_the_window_from_its_prompt_continues_exactly():
    """The entry replays prompt + history with a fresh sampler `skip`ped past the draws made; the window comes
    from that prompt's tail (`with_context`), so the tokens after the replay are the uninterrupted run's."""
    rows = np.random.default_rng(0).normal(0, 2, (40, VOCAB)).astype(np.float32)  # a model: a row per step
    base = SamplingParams(
        temperature=0.8, seed=5, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, penalty_last_n=8
    )
    prompt = [3, 4, 3, 9]

    def run(params: SamplingParams, tokens: list[int], steps: range) -> list[int]:
        p, state = with_context(params, tokens), SamplerState.from_seed(params.seed, skip=steps.start)
        return [sample_rows(rows[i][None], [p], [state])[0].token for i in steps]

    whole = run(base, prompt, range(40))
    for k in (1, 5, 17):
        assert whole[:k] + run(base, prompt + whole[:k], range(k, 40)) == whole
    plain = dataclasses.replace(base, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
    assert run(plain, prompt, range(40)) != whole  # the penalties did change the draws


def test_penalized_rows_sample_alike_alone_and_in_a_batch_beside_plain_ones():
    rng = np.random.default_rng(1)
    rows = rng.normal(0, 2, (6, VOCAB)).astype(np.float32)
    ps = [
        with_context(SamplingParams(temperature=t, seed=i, frequency_penalty=f, min_p=m), [1, 2, 2, 3])
        for i, (t, f, m) in enumerate(
            [(0.0, 1.0, 0), (0.9, 0.5, 0.1), (1.0, 0, 0), (0.7, -0.5, 0.3), (0, 0, 0), (1, 2, 0)]
        )
    ]
    alone = [sample_rows(rows[i][None], [p], [SamplerState.from_seed(p.seed)])[0] for i, p in enumerate(ps)]
    together = sample_rows(rows, ps, [SamplerState.from_seed(p.seed) for p in ps])
    assert together == alone


def test_logprobs_are_the_models_own_distribution_not_the_penalized_one():
    row = np.random.default_rng(2).normal(0, 2, VOCAB).astype(np.float32)
    plain = sample_rows(row[None], [SamplingParams(temperature=0.0, top_logprobs=3)], [SamplerState()])[0]
    biased = SamplingParams(temperature=0.0, top_logprobs=3, logit_bias=((plain.token, -100.0),))
    result = sample_rows(row[None], [biased], [SamplerState()])[0]
    assert result.token != plain.token and result.top_logprobs == plain.top_logprobs


def test_min_p_draws_only_tokens_at_least_min_p_times_as_likely_as_the_best():
    row = np.log(np.array([1.0, 0.5, 0.2, 0.05] + [0.01] * (VOCAB - 4), dtype=np.float32))
    p, state = SamplingParams(temperature=1.0, seed=0, min_p=0.15), SamplerState.from_seed(0)
    drawn = {sample_rows(row[None], [p], [state])[0].token for _ in range(400)}
    assert drawn == {0, 1, 2}


def test_a_snapshot_rewinds_the_window_with_the_random_stream():
    p = with_context(SamplingParams(temperature=1.0, seed=4, presence_penalty=1.0, penalty_last_n=4), [1, 2])
    row = np.zeros(VOCAB, dtype=np.float32)
    state = SamplerState.from_seed(4)
    sample_rows(row[None], [p], [state])
    snap = state.snapshot()
    first = [sample_rows(row[None], [p], [state])[0].token for _ in range(5)]
    state.restore(snap)
    assert [sample_rows(row[None], [p], [state])[0].token for _ in range(5)] == first


def test_speculative_verification_emits_what_plain_penalized_sampling_does():
    """Each position's window holds the tokens emitted before it, so drafts verified with penalties are exact."""
    rows = np.random.default_rng(3).normal(0, 1, (5, VOCAB)).astype(np.float32)
    p = with_context(SamplingParams(temperature=0.0, frequency_penalty=1.5, penalty_last_n=8), [0, 1])
    plain_state, plain = SamplerState(), []
    for i in range(5):
        plain.append(sample_rows(rows[i][None], [p], [plain_state])[0].token)
    state = SamplerState()
    emitted = [r.token for r in verify(rows, tuple(plain[:4]), p, state)]
    assert emitted == plain and list(state.recent) == list(plain_state.recent)


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": float("nan")},
        {"repetition_penalty": 0.0},
        {"penalty_last_n": MAX_PENALTY_WINDOW + 1},
        {"penalty_last_n": 2, "penalty_context": (1, 2, 3)},
        {"penalty_context": (-1,)},
        {"logit_bias": ((5, 1.0), (2, 1.0))},
        {"logit_bias": ((5, 1.0), (5, 2.0))},
        {"logit_bias": ((5, 101.0),)},
        {"min_p": 1.5},
    ],
)
def test_out_of_range_fields_are_refused(fields):
    with pytest.raises(ValueError):
        SamplingParams(**fields)


def test_the_fields_cross_the_wire_unchanged_and_a_bad_message_is_refused():
    p = SamplingParams(
        temperature=0.7,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.1,
        penalty_last_n=6,
        penalty_context=(1, 2, 3),
        logit_bias=((5, -100.0), (9, 2.5)),
    )
    assert wire.decode_sampling(wire.encode_sampling(p)) == p
    assert wire.decode_sampling(wire.encode_sampling(SamplingParams())) == SamplingParams()
    m = wire.encode_sampling(p)
    m.logit_bias.add(token=1, bias=1.0)  # out of order
    with pytest.raises(wire.WireError):
        wire.decode_sampling(m)
    m = wire.encode_sampling(dataclasses.replace(p, penalty_last_n=MAX_PENALTY_WINDOW))
    m.penalty_context.extend([0] * (MAX_PENALTY_WINDOW + 1))
    with pytest.raises(wire.WireError):
        wire.decode_sampling(m)


def test_openai_bodies_carry_penalties_bias_and_llama_servers_extensions():
    from node.http.schema import parse_chat

    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "logit_bias": {"50": -100, "7": 5},
        "repeat_penalty": 1.2,
        "repeat_last_n": 128,
        "min_p": 0.1,
    }
    s = parse_chat(body).options.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.penalty_last_n, s.min_p) == (
        0.5,
        0.25,
        1.2,
        128,
        0.1,
    )
    assert s.logit_bias == ((7, 5.0), (50, -100.0))
    vllm = parse_chat({k: v for k, v in body.items() if k != "repeat_penalty"} | {"repetition_penalty": 1.3})
    assert vllm.options.sampling.repetition_penalty == 1.3
