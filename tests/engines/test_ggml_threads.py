"""The ggml engine may change its thread count between any two steps (its governor does, under load) and its
outputs stay bit for bit those of a fixed count."""

from __future__ import annotations

import numpy as np

from shards.engines.base import StepInput
from shards.engines.ggml.engine import GgmlEngine
from shards.engines.ggml.threads import ThreadGovernor
from shards.formats.loader import load_config
from shards.model.shard import Shard
from tests.support.gguf_util import fixture


class Alternating(ThreadGovernor):
    """A governor that answers 2, 1, 2, 1, ... (as a neighbour coming and going would make it)."""

    def __init__(self):
        super().__init__(2, adapt=False)
        self.calls = 0

    def threads(self) -> int:
        self.calls += 1
        return 2 if self.calls % 2 else 1


def engine(path, threads: int) -> GgmlEngine:
    cfg = load_config(path)
    return GgmlEngine(path, Shard("m", 0, cfg.n_layers, cfg.n_layers), cfg, threads=threads, adapt_threads=False)


def steps(e: GgmlEngine) -> list[np.ndarray]:
    out = e.forward(
        [
            StepInput("a", tokens=np.arange(1, 20), max_positions=40),
            StepInput("b", tokens=np.arange(5, 9), max_positions=40),
        ]
    )
    for t in range(5):
        out += e.forward([StepInput("a", tokens=np.array([t + 3])), StepInput("b", tokens=np.array([t + 7]))])
    return out


def test_switching_threads_between_steps_changes_no_bit_of_the_outputs():
    path = fixture("qwen3")
    fixed = steps(engine(path, 1))
    switching = engine(path, 2)
    switching.governor = Alternating()
    out = steps(switching)
    assert switching.governor.calls == 6 and switching.step_threads in (1, 2)
    for a, b in zip(fixed, out):
        assert np.array_equal(a, b)
