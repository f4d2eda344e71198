"""The ggml engine keeps a mixture of experts' stacked experts in CPU_REPACK where the CPU has a mul_mat_id kernel
for their type, as llama.cpp does (so its logits are llama.cpp's bit for bit: bench/bench_agreement.py), and the
repacked experts keep every guarantee of the plain ones: the same math, and a row's logits whatever was batched
beside it and however its prompt was chunked."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.base import StepInput
from shards.engines.ggml.backend import GgmlBackend
from shards.engines.ggml.lib import F32, I32, Context, g, quantize, repack_supported
from shards.engines.registry import engine_class, installed
from shards.formats.loader import load_config
from shards.formats.quant import QuantizedTensor
from shards.model.shard import Shard
from tests.support.ggml_graph import computed
from tests.support.models import FIXTURES

pytestmark = pytest.mark.skipif("ggml" not in installed(), reason="the ggml engine is not installed")

MODEL = FIXTURES / "moe" / "qwen3moe"  # hidden 64, 8 experts of 32, 2 per token, 3 layers
CFG = load_config(MODEL)
Q4_0 = 2
EXPERTS_NE = (CFG.hidden_size, CFG.moe.expert_size, CFG.moe.n_experts)  # ggml order: [in, out, experts]
PROMPT = np.random.default_rng(3).integers(3, CFG.vocab_size, 40)


def make(repack: bool = True):
    shard = Shard("m", 0, CFG.n_layers, CFG.n_layers)
    return engine_class("ggml")(MODEL, shard, CFG, threads=2, quantize="q4_0", repack=repack)


def logits(engine, rid: str, chunks: list[np.ndarray]) -> np.ndarray:
    rows = [engine.forward([StepInput(rid, tokens=c, max_positions=64)], all_logits=True)[0] for c in chunks]
    engine.release(rid)
    return np.concatenate(rows)


needs_kernel = pytest.mark.skipif(
    not repack_supported(Q4_0, EXPERTS_NE), reason="this CPU has no repacked mul_mat_id kernel for Q4_0"
)


@needs_kernel
def test_stacked_experts_go_to_cpu_repack_as_llama_cpp_places_them():
    e = make()
    # per layer: the fused q/k/v and the output projection, and the 3 stacked expert tensors
    assert e.ops.repacked.get("Q4_0", 0) >= 5 * CFG.n_layers
    assert make(repack=False).ops.repacked == {}


def mul_mat_id(experts: QuantizedTensor, x: np.ndarray, ids: np.ndarray, repack: bool) -> tuple[np.ndarray, dict]:
    """y[r, j] = experts[ids[r, j]] @ x[r] through one ggml_mul_mat_id, on experts placed as the engine places them."""
    ops = GgmlBackend(CFG, 1, repack)
    backend = g.ggml_backend_cpu_init()
    ctx = ops.ctx = Context(8, graph=True)
    try:
        w = ops.experts(experts, experts, experts).gate
        xin, idx = ops.input(F32, (len(x), 1, x.shape[1])), ops.input(I32, ids.shape)
        y = ops.wrap(ops.node(g.ggml_mul_mat_id, w, xin.t, idx.t), (*ids.shape, experts.shape[1]))
        with computed(ctx, backend, [y], [(xin, x), (idx, ids)]):
            return ops.to_numpy(y), dict(ops.repacked)
    finally:
        ctx.free()
        ops.free()
        g.ggml_backend_free(backend)


def q8_0_error(dense: np.ndarray, x: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, float]:
    """What Q8_0 activations may cost each output of `dense[ids] @ x`, whatever the kernel: each activation is
    rounded to its block's step amax/127. At worst half a step (plus the F16 rounding of the step, 2^-11 of up to 127
    steps) times the weights it meets, plus float32 accumulation over the dot; typically (rounding errors uniform
    and independent) the RMS of step^2/12 times the squared weights."""
    step = np.abs(x.reshape(len(x), -1, 32)).max(-1, keepdims=True) / 127
    step = np.broadcast_to(step, (*step.shape[:2], 32)).reshape(x.shape)
    w = dense[ids]  # [rows, k, out, in]
    worst = np.einsum("rkoi,ri->rko", np.abs(w), step * (0.5 + 127 * 2.0**-11) + x.shape[1] * 2.0**-23 * np.abs(x))
    typical = float(np.sqrt(np.mean(np.einsum("rkoi,ri->rko", w**2, step**2 / 12))))
    return worst, typical


@needs_kernel
def test_repacked_experts_compute_what_the_plain_ones_do():
    """Both kernels of a Q4_0 mul_mat_id land within what Q8_0 activations may cost of the exact product of the
    same blocks, at worst and typically, so the repacked one is as close to it as the plain one on any CPU.
    Finding: same activation quantization, another summation order, which a routed model's flipped roundings and
    top-k choices amplify past any fixed bound on logits."""
    rng = np.random.default_rng(5)
    experts, rows, dot, k = 8, 64, 256, 2
    w = rng.standard_normal((experts * rows, dot), dtype=np.float32)
    qt = QuantizedTensor("experts", Q.Q4_0, (experts, rows, dot), quantize(w, Q4_0))
    dense = qt.dequantize().astype(np.float64)  # gguf-py's reference dequantizer
    x = rng.standard_normal((24, dot), dtype=np.float32)
    ids = np.argsort(rng.random((24, experts)), axis=1)[:, :k].astype(np.int32)
    exact = np.einsum("rkoi,ri->rko", dense[ids], x.astype(np.float64))
    worst, typical = q8_0_error(dense, x, ids)
    (repacked, placed), (plain, unplaced) = mul_mat_id(qt, x, ids, True), mul_mat_id(qt, x, ids, False)
    assert placed == {"Q4_0": 3} and unplaced == {}
    for y in (repacked, plain):
        assert (np.abs(y - exact) <= worst).all()
        assert np.sqrt(np.mean((y - exact) ** 2)) < 1.2 * typical  # a bit fewer in the activations: 2x


@needs_kernel
def test_a_rows_logits_do_not_depend_on_how_its_prompt_was_chunked():
    e = make()
    whole = logits(e, "a", [PROMPT])
    assert np.array_equal(whole, logits(e, "b", np.array_split(PROMPT, [1, 7, 20])))
    assert np.array_equal(whole, logits(e, "c", [PROMPT[i : i + 1] for i in range(len(PROMPT))]))


@needs_kernel
def test_a_request_batched_with_others_equals_its_solo_run():
    e = make()
    solo = logits(e, "solo", [PROMPT[:16]])
    other = np.random.default_rng(4).integers(3, CFG.vocab_size, 16)
    batch = e.forward(
        [StepInput("x", tokens=PROMPT[:16], max_positions=64), StepInput("y", tokens=other, max_positions=64)],
        all_logits=True,
    )
    assert np.array_equal(batch[0], solo)
