"""The ggml engine's mixture-of-experts layer on float32 experts (a GGUF converted with --outtype f32) is the float
computation of the same weights: routing, renormalised top-k weights and the experts' SwiGLU, against a float64
numpy reference, to float32 rounding. What keeps its logits off a float reference (the F16 key/value cache, as
llama.cpp's) is elsewhere, so a disagreement with llama.cpp on such a file is a near-tie of the logits or of a
router, not the expert path (bench/agreement_greedy.py, docs/correctness.md "Agreement with llama.cpp")."""

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.ggml.backend import GgmlBackend
from shards.engines.ggml.lib import F32, Context, g
from shards.engines.moe_backend import top_experts
from shards.engines.registry import installed
from shards.formats.loader import load_config
from tests.support.ggml_graph import computed
from tests.support.models import FIXTURES

pytestmark = pytest.mark.skipif("ggml" not in installed(), reason="the ggml engine is not installed")

CFG = load_config(FIXTURES / "moe" / "qwen3moe")


def ggml_moe(gate, up, down, x, logits, n_used: int, normalize: bool) -> np.ndarray:
    """GgmlBackend.moe in one graph on float32 experts [E, ff, h], [E, ff, h], [E, h, ff]."""
    ops = GgmlBackend(CFG, 1)
    backend = g.ggml_backend_cpu_init()
    ctx = ops.ctx = Context(64, graph=True)
    try:
        experts = ops.experts(gate, up, down)
        xin, lin = ops.input(F32, x.shape), ops.input(F32, logits.shape)
        y = ops.moe(xin, lin, experts, n_used, normalize)
        y = ops.contiguous(y)
        with computed(ctx, backend, [y], [(xin, x), (lin, logits)]):
            return ops.to_numpy(y)
    finally:
        ctx.free()
        ops.free()
        g.ggml_backend_free(backend)


def float64_moe(gate, up, down, x, logits, n_used: int, normalize: bool) -> np.ndarray:
    ids, _ = top_experts(logits, n_used, normalize)
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    w = np.take_along_axis(p, ids, -1)
    w = w / w.sum(-1, keepdims=True) if normalize else w
    out = np.zeros(x.shape, np.float64)
    for r in range(len(x)):
        for j, e in enumerate(ids[r]):
            a, b = gate[e] @ x[r], up[e] @ x[r]
            out[r] += w[r, j] * (down[e] @ (a / (1 + np.exp(-a)) * b))
    return out


@pytest.mark.parametrize("normalize", [True, False])
def test_float32_experts_compute_the_float_moe_of_their_weights(normalize):
    rng = np.random.default_rng(11)
    experts, h, ff, n, k = 16, 256, 128, 40, 4
    gate = rng.standard_normal((experts, ff, h), dtype=np.float32) / np.sqrt(h)
    up = rng.standard_normal((experts, ff, h), dtype=np.float32) / np.sqrt(h)
    down = rng.standard_normal((experts, h, ff), dtype=np.float32) / np.sqrt(ff)
    x = rng.standard_normal((n, h), dtype=np.float32)
    logits = 2 * rng.standard_normal((n, experts), dtype=np.float32)  # clear routing: no top-k tie to flip
    ours = ggml_moe(gate, up, down, x, logits, k, normalize)
    ref = float64_moe(*(a.astype(np.float64) for a in (gate, up, down, x)), logits, k, normalize)
    assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max()
