"""Device memory freed while a node runs on: step graphs dropped from the cache between steps (their scheduler and
compute buffers freed), the KV pool outgrowing its buffer, an engine closed and another started on the same device.
Each frees buffers the device computed with a step before; the process runs on and computes what it computed.

(Lavapipe from Mesa 22.3 fails this: its heap came apart within a few steps of the first drop; tests/gpu/conftest.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.base import StepInput  # noqa: E402
from tests.gpu.test_device_engine import engine  # noqa: E402
from tests.support.models import FIXTURES  # noqa: E402

PROMPTS = [37 * k % 180 + 5 for k in range(18)]  # lengths 5-184, each held with room to grow: the pool grows


def workload(device: str) -> tuple[list[np.ndarray], int, int]:
    """Requests of many lengths, each held after its prompt and two decode steps, on a fresh engine whose cache keeps
    no graph beside the newest: (every step's logits, graphs built, the pool's growths)."""
    e = engine(FIXTURES / "llama", quantize="none", device=device)
    e.runner.graphs.spare_bytes = 0
    rng = np.random.default_rng(0)
    out = []
    for k, n in enumerate(PROMPTS):
        out += e.forward([StepInput(f"r{k}", tokens=rng.integers(3, 200, n), max_positions=n + 250)])
        for _ in range(2):
            out += e.forward([StepInput(f"r{k}", tokens=rng.integers(3, 200, 1))])
    built, grown = e.runner.graphs.builds, e.pool.generation
    e.close()
    return out, built, grown


def test_graphs_dropped_a_growing_pool_and_a_closed_engine_leave_the_device_computing_the_same(gpu):
    first, built, grown = workload(gpu.name)
    assert built >= len(PROMPTS) and grown >= 1  # graphs were dropped and rebuilt, the pool moved
    again, _, _ = workload(gpu.name)  # after an engine on the device closed
    assert len(again) == len(first) and all(np.isfinite(x).all() for x in first)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
