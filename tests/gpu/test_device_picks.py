"""On a GPU backend's device the picking tail (shards/engines/ggml/picks.py) runs where the logits are: a greedy
row's token is the sampler's greedy token over the device's own logits, and only the rows not picked bring their
logits back to the host."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.decoding.sampling import SamplerState, SamplingParams, sample_one  # noqa: E402
from shards.engines.base import StepInput  # noqa: E402
from shards.engines.ggml.engine import GgmlEngine  # noqa: E402
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
