"""Greedy tokens picked where the logits are (shards/engines/picks.py, the ggml graph tail in shards/engines/ggml/
picks.py): every engine's `pick` gives the sampler's greedy token or the row's own logits, never another token."""

import numpy as np
import pytest

from shards.decoding.sampling import SamplerState, SamplingParams, sample_one
from shards.engines.base import EngineInputError, StepInput
from shards.engines.picks import Pick, host_pick
from shards.engines.registry import engine_class, installed
from shards.formats.config import ModelConfig
from shards.model.shard import Shard
from tests.conftest import FIXTURES

LLAMA = FIXTURES / "llama"
VOCAB = 64


def make(name: str, start: int = 0, end: int = 6):
    options = {"threads": 1} if name == "ggml" else {}
    return engine_class(name)(LLAMA, Shard("llama", start, end, 6), ModelConfig.from_dir(LLAMA), **options)


def greedy(row: np.ndarray) -> int:
    return sample_one(row, SamplingParams(temperature=0.0), SamplerState()).token


def crafted_rows() -> np.ndarray:
    """Rows whose maximum is single, tied (first and last, neighbours, far apart), NaN, +inf, or beside -inf."""
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((12, VOCAB)).astype(np.float32)
    rows[1, [0, VOCAB - 1]] = 9.0  # tied at both ends
    rows[2, [40, 41]] = 9.0  # tied neighbours (within one SIMD block)
    rows[3, [3, 35, 60]] = 9.0  # three tied
    rows[4, 17] = np.nan
    rows[5, 9] = np.inf
    rows[6, :] = -np.inf
    rows[6, 20] = 1.0  # the rest masked: a single finite maximum
    rows[7, 5] = -np.inf
    rows[8, :] = 0.0  # all tied
    rows[9, 30] = np.nan
    rows[9, 31] = 50.0  # a NaN beside a larger finite maximum
    rows[10, 63] = 12.0  # the maximum last
    rows[11, 0] = 12.0  # the maximum first
    return rows


def test_the_host_rule_picks_a_single_finite_maximum_and_hands_back_every_other_row():
    rows = crafted_rows()
    picks = [host_pick(r) for r in rows]
    picked = {i for i, p in enumerate(picks) if p.tokens is not None}
    assert picked == {0, 6, 7, 10, 11}
    for i in picked:
        assert picks[i].tokens == (greedy(rows[i]),)
    for i in set(range(len(rows))) - picked:
        assert np.array_equal(picks[i].logits, rows[i : i + 1], equal_nan=True)
    assert host_pick(rows[0], wanted=False).tokens is None  # a row not asked for comes back as logits
    block = host_pick(rows[[0, 6, 10]])  # a block's rows: a token each
    assert block.tokens == tuple(greedy(rows[i]) for i in (0, 6, 10))
    spoilt = host_pick(rows[[0, 2, 10]])  # one tie in the block: every row's logits
    assert spoilt.tokens is None and np.array_equal(spoilt.logits, rows[[0, 2, 10]])


def test_a_pick_holds_a_token_or_its_rows_logits_never_both():
    with pytest.raises(ValueError, match="exactly one"):
        Pick(tokens=(3,), logits=np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="exactly one"):
        Pick()
    with pytest.raises(ValueError, match="one per row"):
        Pick(tokens=())
    with pytest.raises(ValueError, match=r"\[rows, vocab\]"):
        Pick(logits=np.zeros(4, np.float32))


def test_the_ggml_tail_on_crafted_rows_follows_the_host_rule_whatever_ggmls_tie_breaking():
    pytest.importorskip("ggml")
    from shards.engines.ggml import picks as tail_picks
    from shards.engines.ggml.backend import GgmlBackend
    from shards.engines.ggml.lib import F32, Context, g
    from tests.support.ggml_graph import computed

    rows = crafted_rows()
    ops = GgmlBackend.__new__(GgmlBackend)  # only its graph-node helpers: no model
    ctx = ops.ctx = Context(64, graph=True)
    backend = g.ggml_backend_cpu_init()
    try:
        logits = ops.input(F32, rows.shape)
        ids, stats = tail_picks.tail(ops, logits)
        wrap = [ops.wrap(t, ()) for t in (ids, stats)]
        with computed(ctx, backend, [logits, *wrap], [(logits, rows)]):
            lone = [(i, i + 1) for i in range(len(rows))]
            got = tail_picks.read(ids, stats, logits.t, VOCAB, [True] * len(rows), lone)
            not_asked = tail_picks.read(ids, stats, logits.t, VOCAB, [False, True], lone[:2])
            blocks = tail_picks.read(ids, stats, logits.t, VOCAB, [True, True, True], [(5, 8), (9, 12), (10, 12)])
    finally:
        g.ggml_backend_free(backend)
        ctx.free()
    for i, (p, ref) in enumerate(zip(got, (host_pick(r) for r in rows))):
        assert p.tokens == ref.tokens, f"row {i}"
        if p.tokens is None:
            assert np.array_equal(p.logits, ref.logits, equal_nan=True), f"row {i}"
    assert not_asked[0].tokens is None and np.array_equal(not_asked[0].logits, rows[:1])
    assert not_asked[1].tokens == got[1].tokens is None  # a tie is never picked, asked or not
    for p, (a, b) in zip(blocks, [(5, 8), (9, 12), (10, 12)]):  # blocks of rows: picked only where every row is
        ref = host_pick(rows[a:b])
        assert p.tokens == ref.tokens
        if p.tokens is None:
            assert np.array_equal(p.logits, rows[a:b], equal_nan=True)
    assert [p.tokens is None for p in blocks] == [True, True, False]


@pytest.mark.parametrize("name", installed())
def test_every_engines_picks_are_the_greedy_tokens_of_its_own_logits_step_after_step(name):
    picking, forwarding = make(name), make(name)
    rng = np.random.default_rng(0)
    ids = ["a", "b", "c", "d"]
    batch = [StepInput(r, tokens=rng.integers(0, 200, 5 + i)) for i, r in enumerate(ids)]
    wanted = [True, False, True, True]
    for _ in range(5):
        picks, outs = picking.pick(batch, wanted), forwarding.forward(batch)
        assert [p.tokens is not None for p in picks] == wanted  # random logits: every maximum single
        tokens = []
        for p, out in zip(picks, outs):
            if p.tokens is None:
                assert np.array_equal(p.logits, out[-1:])  # not asked: the very logits forward gives
            else:
                assert p.tokens == (greedy(out[-1]),)
            tokens.append(greedy(out[-1]))
        batch = [StepInput(r, tokens=np.array([t])) for r, t in zip(ids, tokens)]
    assert picking.cache_length("a") == forwarding.cache_length("a") == 9
    # blocks of every row (proposals to verify) beside a decode row: a token per row
    batch = [StepInput("a", tokens=np.array([5, 6, 7])), StepInput("b", tokens=np.array([8])), batch[2]]
    picks, outs = picking.pick(batch, [True, True, False], all_logits=True), forwarding.forward(batch, all_logits=True)
    assert picks[0].tokens == tuple(greedy(r) for r in outs[0]) and len(picks[0].tokens) == 3
    assert picks[1].tokens == (greedy(outs[1][0]),)
    assert np.array_equal(picks[2].logits, outs[2])
    if name == "ggml":  # on the CPU the logits are in host memory: picked there, the graphs have no tail
        assert picking.graphs.graphs and not any(shape.picks for shape in picking.graphs.graphs)


def test_picks_come_only_from_the_last_shard_with_one_flag_per_request():
    first = make("numpy", 0, 3)
    with pytest.raises(EngineInputError, match="last shard"):
        first.pick([StepInput("a", tokens=np.arange(3))], [True])
    with pytest.raises(EngineInputError, match="one flag per request"):
        make("numpy").pick([StepInput("a", tokens=np.arange(3))], [True, True])
