"""On a GPU backend's device the picking tail (shards/engines/ggml/picks.py) runs where the logits are: a greedy
row's token is the sampler's greedy token over the device's own logits, and only the rows not picked bring their
logits back to the host."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.decoding.sampling import SamplerState, SamplingParams, sample_best, sample_one  # noqa: E402
from shards.engines.base import StepInput  # noqa: E402
from shards.engines.ggml.engine import GgmlEngine  # noqa: E402
from shards.engines.picks import Draw  # noqa: E402
from shards.formats.loader import load_config  # noqa: E402
from shards.model.shard import Shard  # noqa: E402
from tests.support.models import FIXTURES  # noqa: E402


def device_engine(device: str) -> GgmlEngine:
    path = FIXTURES / "llama"
    cfg = load_config(path)
    shard = Shard("m", 0, cfg.n_layers, cfg.n_layers)
    return GgmlEngine(path, shard, cfg, threads=2, adapt_threads=False, quantize="none", device=device)


def test_picks_on_the_device_are_the_greedy_tokens_of_the_devices_own_logits(gpu):
    picking, forwarding = device_engine(gpu.name), device_engine(gpu.name)
    assert picking.on is not None and picking.on.device == gpu
    ids, wanted = ["a", "b", "c"], [True, False, True]
    rng = np.random.default_rng(3)
    batch = [StepInput(r, tokens=rng.integers(3, 400, 4 + 3 * i)) for i, r in enumerate(ids)]
    try:
        for _ in range(6):
            picks, outs = picking.pick(batch, wanted), forwarding.forward(batch)
            tokens = []
            for p, out, w in zip(picks, outs, wanted):
                token = sample_one(out[-1], SamplingParams(temperature=0.0), SamplerState()).token
                assert p.tokens == ((token,) if w else None)  # the same graph shapes: the same logits, bit for bit
                if p.tokens is None:
                    assert np.array_equal(p.logits, out[-1:])
                tokens.append(token)
            batch = [StepInput(r, tokens=np.array([t])) for r, t in zip(ids, tokens)]
        # a block of every row (proposals to verify) beside a decode row: the tail over the step's every row
        batch = [StepInput("a", tokens=np.array([5, 6, 7])), batch[1], batch[2]]
        picks = picking.pick(batch, [True, True, False], all_logits=True)
        outs = forwarding.forward(batch, all_logits=True)
        greedy = [[sample_one(r, SamplingParams(temperature=0.0), SamplerState()).token for r in o] for o in outs]
        assert picks[0].tokens == tuple(greedy[0]) and picks[1].tokens == tuple(greedy[1])
        assert np.array_equal(picks[2].logits, outs[2])
        assert {s.picks for s in picking.graphs.graphs} == {True} and not any(s.picks for s in forwarding.graphs.graphs)
    finally:
        picking.close()
        forwarding.close()


def test_a_top_k_row_on_the_device_is_drawn_from_its_best_logits_as_from_the_row(gpu):
    """A drawn row (shards/engines/picks.py `Draw`) comes back as its 128 best ids and values, which the device's
    top-k took and `best_of` checked: seeded draws from them are the draws from the device's own logits."""
    drawing, forwarding = device_engine(gpu.name), device_engine(gpu.name)
    assert drawing.runner.top_k  # the device has ggml's top-k kernel
    params = [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1),  # Ollama's defaults
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, top_k=100, min_p=0.05, seed=2),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3),  # no top-k: its logits
    ]
    wanted = [Draw.of(params[0]), True, Draw.of(params[2]), False]
    assert isinstance(wanted[0], Draw) and isinstance(wanted[2], Draw) and Draw.of(params[3]) is None
    ids = ["a", "b", "c", "d"]
    drawn_states = [SamplerState.from_seed(p.seed) for p in params]
    row_states = [SamplerState.from_seed(p.seed) for p in params]
    rng = np.random.default_rng(4)
    batch = [StepInput(r, tokens=rng.integers(3, 400, 3 + 2 * i)) for i, r in enumerate(ids)]
    taken = 0
    try:
        for _ in range(8):
            picks, outs = drawing.pick(batch, wanted), forwarding.forward(batch)
            tokens = []
            for pick, out, p, ds, rs in zip(picks, outs, params, drawn_states, row_states):
                want = sample_one(out[-1], p, rs).token
                if pick.best is not None:
                    taken += 1
                    assert sample_best(pick.best.ids, pick.best.values, p, ds).token == want
                    assert np.array_equal(pick.best.values, out[-1][pick.best.ids])  # the device's own values
                elif pick.tokens is not None:
                    assert pick.tokens == (want,)
                else:
                    assert np.array_equal(pick.logits, out[-1:])
                    assert sample_one(pick.logits[-1], p, ds).token == want
                tokens.append(want)
            batch = [StepInput(r, tokens=np.array([t])) for r, t in zip(ids, tokens)]
        assert taken >= 12  # of 16 drawn rows: a row not taken is a tie at its k-th place (rare)
        assert {(s.picks, s.best) for s in drawing.graphs.graphs} == {(True, True)}
    finally:
        drawing.close()
        forwarding.close()


def test_a_row_whose_bias_and_penalties_only_lower_logits_is_drawn_on_the_device_as_from_the_row(gpu):
    """A greedy or top-k row with a repetition penalty, a presence penalty and banned tokens (which only lower its
    logits: penalties.lowers_only) is drawn from its 128 best too: the bias and penalties applied to them on the
    host over the window the plan froze, its token and its growing window those of the whole row's."""
    drawing, forwarding = device_engine(gpu.name), device_engine(gpu.name)
    penalties = dict(repetition_penalty=1.3, presence_penalty=0.5, penalty_last_n=8)
    params = [
        SamplingParams(temperature=0.0, logit_bias=((7, -100.0), (9, -2.0)), **penalties),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=5, **penalties),
    ]
    ids = ["greedy", "top-k"]
    drawn_states = [SamplerState.from_seed(p.seed) for p in params]
    row_states = [SamplerState.from_seed(p.seed) for p in params]
    rng = np.random.default_rng(6)
    batch = [StepInput(r, tokens=rng.integers(3, 400, 5)) for r in ids]
    taken = 0
    try:
        for _ in range(10):
            wanted = [Draw.of(p, tuple(s.window(p))) for p, s in zip(params, drawn_states)]
            assert all(isinstance(w, Draw) and w.processed is not None for w in wanted)
            picks, outs = drawing.pick(batch, wanted), forwarding.forward(batch)
            tokens = []
            for pick, out, p, ds, rs in zip(picks, outs, params, drawn_states, row_states):
                want = sample_one(out[-1], p, rs).token
                got = (
                    sample_best(pick.best.ids, pick.best.values, p, ds)
                    if pick.best is not None
                    else sample_one(pick.logits[-1], p, ds)
                )
                taken += pick.best is not None
                assert got.token == want and list(ds.window(p)) == list(rs.window(p))
                tokens.append(want)
            batch = [StepInput(r, tokens=np.array([t])) for r, t in zip(ids, tokens)]
        assert taken >= 16  # of 20
    finally:
        drawing.close()
        forwarding.close()
