"""A ring's relayed pass laid out while its inputs are on their way (node/runtime/engine_step.py `lay_ahead`): once
every input came it is the pass `relayed_pass` makes of them, and computes what that pass computes; an input
missing, of another shape or with values the engine refuses leaves it unused and unchanged (the pass is then laid
out as usual, which refuses what is wrong); a row the engine would refuse lays nothing out."""

import dataclasses

import numpy as np
import pytest

from node.core.step_plan import Row, Sampling, StepPlan, relayed_pass
from node.runtime.engine_step import lay_ahead, run_pass
from shards.decoding.sampling import SamplerState, SamplingParams
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.config import ModelConfig
from shards.model.shard import Shard
from tests.support.factories import CFG, tokens
from tests.support.models import FIXTURES

FIRST, LAST = Shard("llama", 0, 3, 6), Shard("llama", 3, 6, 6)


def engine(shard: Shard) -> NumpyEngine:
    return NumpyEngine(FIXTURES / "llama", shard, ModelConfig.from_dir(FIXTURES / "llama"))


def ran(e: NumpyEngine, first_input: np.ndarray) -> StepPlan:
    """`e` with request r's prompt and one decode step run: the decode step's plan (relayed, as a ring's)."""
    ask = Sampling(SamplingParams(temperature=0), SamplerState()) if e.shard.is_last else None
    prompt = Row("r", first_input, 20, sample=ask)
    run_pass(e, StepPlan(e.shard, None, (prompt,)), None)
    step = Row("r", first_input[-1:], 20, sample=ask, relay=True)
    plan = StepPlan(e.shard, None, (step,), 123)
    run_pass(e, plan, None)
    return plan


def hidden_rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, CFG.hidden_size)).astype(np.float32)


@pytest.mark.parametrize("shard", [FIRST, LAST], ids=["first", "last"])
def test_once_every_input_came_the_pass_laid_out_ahead_is_the_relayed_pass_and_computes_the_same(shard):
    usual, ahead = engine(shard), engine(shard)
    first_input = tokens(5, 6, 7) if shard.is_first else hidden_rows(3, 1)
    plan, _ = ran(usual, first_input), ran(ahead, first_input)
    came = {"r": tokens(42) if shard.is_first else hidden_rows(1, 2)}
    laid = lay_ahead(ahead, plan, ("r",), None)
    assert laid is not None and laid.step is None  # (the numpy engine lays out no step of its own ahead)
    assert laid.took(came)
    want = relayed_pass(plan, came)
    (got_row,), (want_row,) = laid.plan.rows, want.rows
    assert np.array_equal(got_row.data, want_row.data)
    assert dataclasses.replace(got_row, data=want_row.data) == want_row
    assert (laid.plan.shard, laid.plan.bucket, laid.plan.retain_limit) == (want.shard, want.bucket, 123)
    got_out = run_pass(ahead, laid.plan, None, laid).outputs.outputs["r"]
    want_out = run_pass(usual, want, None).outputs.outputs["r"]
    assert np.array_equal(got_out, want_out)
    assert ahead.cache_length("r") == usual.cache_length("r") == 5


@pytest.mark.parametrize(
    "shard, came, why",
    [
        (LAST, {}, "no input came"),
        (LAST, {"r": hidden_rows(1, 0), "s": hidden_rows(1, 0)}, "one nobody waits for"),
        (LAST, {"r": hidden_rows(2, 0)}, "two rows"),
        (LAST, {"r": hidden_rows(1, 0).astype(np.float64)}, "not float32"),
        (FIRST, {"r": tokens(CFG.vocab_size)}, "a token outside the vocabulary"),
        (FIRST, {"r": tokens(-1)}, "a negative token"),
    ],
)
def test_inputs_that_dont_fit_leave_the_pass_laid_out_ahead_unused_and_unchanged(shard, came, why):
    e = engine(shard)
    plan = ran(e, tokens(5, 6, 7) if shard.is_first else hidden_rows(3, 1))
    laid = lay_ahead(e, plan, ("r",), None)
    assert not laid.took(came), why
    assert not laid.plan.rows[0].data.any(), why  # nothing copied in


def test_a_row_the_engine_would_refuse_lays_nothing_out_ahead():
    e = engine(LAST)
    full = hidden_rows(CFG.max_position_embeddings, 3)
    run_pass(e, StepPlan(LAST, None, (Row("r", full, None),)), None)  # every position its model has, taken
    plan = StepPlan(LAST, None, (Row("r", full[-1:], None, relay=True),))
    assert lay_ahead(e, plan, ("r",), None) is None  # its next position is past them: the usual way says so
    assert "exceed" in run_pass(e, relayed_pass(plan, {"r": hidden_rows(1, 0)}), None).outputs.refused["r"]
    assert lay_ahead(e, plan, (), None) is None  # no row awaited
