"""The ggml engine beyond the shared conformance suite: every weight type through ggml's kernels, memory that is the
file's, quantize-on-load, graph reuse and release, and inputs that would make ggml abort the process refused first.
"""

import logging

import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from bench.random_model import write_random_llama
from shards.engines.base import EngineInputError, StepInput
from shards.engines.ggml.backend import GgmlBackend, nocopy_strides
from shards.engines.ggml.cells import CELL_ALIGN
from shards.engines.ggml.engine import GgmlEngine
from shards.engines.ggml.lib import F32, I32, Context, GgmlError, g, quantize, repack_supported
from shards.engines.ggml.repack_probe import repack_keeps_rows, repack_pads_rows
from shards.engines.numpy_engine import NumpyEngine
from shards.engines.registry import engine_factory, resolve
from shards.formats.config import ModelConfig
from shards.formats.gguf_file import open_gguf
from shards.formats.gguf_model import _hf_shapes
from shards.formats.loader import load_config
from shards.formats.quant import SUPPORTED_TYPES, QuantizedTensor
from shards.model.shard import Shard
from shards.reference.generate import chain_forward
from tests.conftest import FIXTURES
from tests.support.ggml_graph import computed
from tests.support.gguf_util import fixture, smollm2_path
from tests.support.tolerance import QUANTIZED_RMS, regrouped_atol, relative_rms

LLAMA = FIXTURES / "llama"


def make(path, start=0, end=None, **options) -> GgmlEngine:
    cfg = load_config(path)
    return GgmlEngine(path, Shard("m", start, end or cfg.n_layers, cfg.n_layers), cfg, threads=1, **options)


# -- every weight type ------------------------------------------------------------------------------------------------
def as_type(w: np.ndarray, t: Q) -> QuantizedTensor:
    if t == Q.F32:
        data = w.view(np.uint8)
    elif t == Q.F16:
        data = w.astype(np.float16).view(np.uint8)
    elif t == Q.BF16:
        data = w.astype(ml_dtypes.bfloat16).view(np.uint8)
    else:
        # ggml's own quantizer (the 1-2 bit IQ types need an imatrix: uniform importance here); gguf-py's
        # independent code dequantizes it below
        importance = np.ones(w.shape[1], np.float32) if g.ggml_quantize_requires_imatrix(int(t)) else None
        data = quantize(w, int(t), importance=importance)
    return QuantizedTensor("w", t, w.shape, data.reshape(w.shape[0], -1))


def run_ops(
    qt: QuantizedTensor, x: np.ndarray, ids: np.ndarray, repack: bool = True
) -> tuple[np.ndarray, np.ndarray, GgmlBackend]:
    """x @ W.T through ggml_mul_mat and W[ids] through ggml_get_rows, on weights uploaded as the engine does (a
    projection, repacked where ggml can; an embedding table, never)."""
    ops = GgmlBackend(ModelConfig.from_dir(LLAMA), 1, repack)
    backend = g.ggml_backend_cpu_init()
    ctx = ops.ctx = Context(16, graph=True)
    try:
        w, table = ops.weight(qt), ops.table(qt)
        xin, idx = ops.input(F32, x.shape), ops.input(I32, ids.shape)
        y, rows = ops.linear(xin, w), ops.embedding(table, idx)
        with computed(ctx, backend, [y, rows], [(xin, x), (idx, ids)]):
            return ops.to_numpy(y), ops.to_numpy(rows), dict(ops.repacked)
    finally:
        ctx.free()
        ops.free()
        g.ggml_backend_free(backend)


# Bound on max|error| / max|x @ W.T| per type: ggml rounds the activations to the weight's dot-product type: F16
# (observed 2e-4), BF16 (1.7e-3), 8-bit blocks for the quantized types (0.45-0.81%; the low-bit Q2_K..MXFP4
# 0.57-0.98%); F32 stays F32 (2e-7).
MATMUL_RTOL = {Q.F32: 1e-5, Q.F16: 1e-3, Q.BF16: 5e-3}


@pytest.mark.parametrize("ggml_type", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_every_weight_type_computes_like_its_dequantized_matrix(ggml_type):
    rng = np.random.default_rng(int(ggml_type))
    w = rng.standard_normal((48, 512), dtype=np.float32)
    x = rng.standard_normal((8, 512), dtype=np.float32)
    qt = as_type(w, ggml_type)
    dense = qt.dequantize()  # gguf-py's reference dequantizer
    ids = np.array([0, 47, 5, 5], dtype=np.int32)
    expected = x @ dense.T
    for repack in (True, False):
        y, rows, repacked = run_ops(qt, x, ids, repack)
        assert np.abs(y - expected).max() / np.abs(expected).max() < MATMUL_RTOL.get(ggml_type, 1.5e-2)
        assert np.allclose(rows, dense[ids], rtol=1e-6, atol=1e-6)  # looked-up rows: the blocks' exact values
        # repacked exactly where llama.cpp's probe finds a kernel for this CPU (here Q4_0 and Q4_K; placing Q4_1,
        # Q8_0 or Q6_K there crashes) that keeps a row's numbers in any batch, or does through its gemm with the rows
        # padded (repack_probe.py), then computing the same
        t = int(ggml_type)
        accepted = repack and repack_supported(t, (512, 48)) and (repack_keeps_rows(t) or repack_pads_rows(t))
        assert repacked == ({ggml_type.name: 1} if accepted else {})


def test_an_unsupported_or_damaged_weight_is_an_error_not_a_crash():
    ops = GgmlBackend(ModelConfig.from_dir(LLAMA), 1)
    try:
        q8_1 = QuantizedTensor("blk.0.ffn_up.weight", Q.Q8_1, (4, 256), np.zeros((4, 288), np.uint8))
        with pytest.raises(ValueError, match="Q8_1 is not supported"):  # an activation type, never a weight's
            ops.weight(q8_1)
        nan = np.full((4, 32), np.nan, np.float32)
        with pytest.raises(ValueError, match="NaN or infinite"):
            ops.weight(as_type(nan, Q.F32))
        short = QuantizedTensor("w", Q.Q8_0, (4, 64), np.zeros((4, 34), np.uint8))  # half the bytes of its shape
        with pytest.raises(ValueError, match="bytes"):
            ops.weight(short)
        if repack_supported(int(Q.Q4_0), (64, 8)):
            with pytest.raises(GgmlError):  # get_rows on a repacked projection would read garbage
                ops.ctx = Context(4)
                ops.embedding(ops.weight(as_type(np.ones((8, 64), np.float32), Q.Q4_0)), ops.input(I32, (2,)))
    finally:
        ops.free()


# -- memory -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path,start,end", [(fixture("llama"), 0, 4), (fixture("qwen2"), 1, 3), (None, 0, 30), (None, 0, 10), (None, 20, 30)]
)
def test_a_shards_weights_take_exactly_their_bytes_in_the_file(path, start, end):
    path = path or smollm2_path()
    engine = make(path, start, end)
    cfg, f = engine.config, open_gguf(path)
    names = {name for name, _, _ in _hf_shapes(cfg, engine.shard)}  # a tied embedding counts once
    assert engine.nbytes() == sum(f.tensor(name).nbytes for name in names)


# -- quantize on load -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    """Rows of 256 and 512 values: whole blocks of every quantize type, q4_k included."""
    return write_random_llama(
        tmp_path_factory.mktemp("m") / "m",
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=512,
    )


# bytes per weight / 4 (float32): q8_0 34 B per 32 values, q4_0 18 B per 32, q4_k 144 B per 256
RATIOS = {"q8_0": 34 / 32 / 4, "q4_0": 18 / 32 / 4, "q4_k": 144 / 256 / 4}


def dequantized_copy(src, kind: str, dst):
    """The checkpoint as the ggml engine holds it after quantizing on load, widened back to float32."""
    import json
    import shutil

    from safetensors.numpy import save_file

    from shards.engines.ggml.weights import load_ggml_shard_weights
    from shards.formats.weights import layer_tensor_shapes

    cfg = load_config(src)
    w = load_ggml_shard_weights(src, cfg, Shard.whole("m", cfg.n_layers), kind, 1)

    def dense(a):
        return a.dequantize() if isinstance(a, QuantizedTensor) else a

    tensors = {
        "model.embed_tokens.weight": dense(w.embed_tokens),
        "lm_head.weight": dense(w.lm_head),
        "model.norm.weight": w.norm,
    }
    for i in range(cfg.n_layers):
        layer = w.layers.pop(0)
        tensors |= {name: dense(getattr(layer, field)) for field, (name, _) in layer_tensor_shapes(cfg, i).items()}
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    shutil.copy(src / "config.json", dst / "config.json")
    assert json.loads((dst / "config.json").read_text())["tie_word_embeddings"] is False
    return dst


@pytest.mark.parametrize("kind", RATIOS)
def test_quantize_on_load_holds_a_fraction_of_float32_and_computes_on_the_quantized_weights(
    random_model, kind, tmp_path
):
    cfg = load_config(random_model)
    dense = NumpyEngine(random_model, Shard.whole("m", cfg.n_layers), cfg)
    quantized = make(random_model, quantize=kind)
    vectors = sum(a.nbytes for a in dense.model.parameters() if a.ndim == 1)  # norms stay float32
    assert quantized.nbytes() - vectors == pytest.approx(RATIOS[kind] * (dense.nbytes() - vectors), rel=1e-9)
    # Against float32 math on the very weights it holds (widened back): what is left is quantized math's own
    # rounding (tests/support/tolerance.py; observed 1.7-3.0%). (Against the original float32 weights these random,
    # untrained matrices lose far more to 4-bit weights: 30-35% RMS, see the ggml figures note.)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 40)
    copy = dequantized_copy(random_model, kind, tmp_path / "copy")
    reference = chain_forward([NumpyEngine(copy, Shard.whole("m", cfg.n_layers), cfg)], "r", tokens, all_logits=True)
    assert relative_rms(chain_forward([quantized], "r", tokens, all_logits=True), reference) < QUANTIZED_RMS


def test_quantize_none_keeps_float32(random_model):
    cfg = load_config(random_model)
    dense = NumpyEngine(random_model, Shard.whole("m", cfg.n_layers), cfg)
    engine = make(random_model, quantize="none")
    assert engine.nbytes() == dense.nbytes()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 40)
    reference = chain_forward([dense], "r", tokens, all_logits=True)
    assert relative_rms(chain_forward([engine], "r", tokens, all_logits=True), reference) < 5e-3  # observed 1.2e-3


def test_rows_that_are_not_whole_blocks_fall_back_per_tensor(tmp_path, caplog):
    # The llama fixture's rows hold 64 or 160 values: not whole q4_k blocks (256), whole q8_0 blocks (32).
    caplog.set_level(logging.INFO, logger="shards.engines.ggml.weights")
    assert make(LLAMA, quantize="q4_k").nbytes() == make(LLAMA, quantize="q8_0").nbytes()
    assert "Q4_K->Q8_0" in caplog.text
    odd = write_random_llama(
        tmp_path / "odd",
        hidden_size=48,
        num_hidden_layers=1,
        num_attention_heads=3,
        num_key_value_heads=1,
        intermediate_size=80,
        vocab_size=64,
    )
    assert make(odd, quantize="q8_0").nbytes() < make(odd).nbytes()
    assert "Q8_0->F16 (rows of 48)" in caplog.text


def test_quantize_is_refused_for_other_engines():
    with pytest.raises(ValueError, match="option of the ggml engine"):
        engine_factory("numpy", LLAMA, quantize="q8_0")
    with pytest.raises(ValueError, match="positive integer"):
        engine_factory("ggml", LLAMA, threads=0)
    assert resolve("auto") == "ggml"  # installed here, so it is the default


# -- graphs and caches ------------------------------------------------------------------------------------------------
def test_decode_steps_reuse_one_graph_whichever_requests_and_release_frees_their_cells():
    engine = make(LLAMA)
    engine.forward([StepInput("a", tokens=np.arange(5), max_positions=40), StepInput("b", tokens=np.arange(3))])
    graphs = dict(engine.graphs.graphs)
    for t in range(3):
        engine.forward([StepInput("a", tokens=np.array([t])), StepInput("b", tokens=np.array([t]))])
    decode = [graph for shape, graph in engine.graphs.graphs.items() if shape not in graphs]
    assert len(decode) == 1  # three steps, one graph
    # K, V, and V again as rows (under gemm_from: one layout per attention), 6 layers, 2 kv heads x 16, F16; a's
    # reservation of 40 positions still takes the smallest range, 256 cells (memory only where written)
    assert engine.cache_bytes() == 3 * 2 * 6 * (256 + 256) * 2 * 16
    engine.release("a")
    assert engine.cache_bytes() == 3 * 2 * 6 * 256 * 2 * 16
    builds = engine.graphs.builds
    engine.forward([StepInput("c", tokens=np.arange(4), max_positions=40)])
    engine.forward([StepInput("c", tokens=np.array([1])), StepInput("b", tokens=np.array([1]))])
    assert engine.graphs.builds == builds + 1  # c's prefill is a new shape; c beside b decodes in a's graph
    assert engine.caches["c"].start == CELL_ALIGN  # first fit: c took the cells a gave back (cell 0: scratch)
    engine.release("b")
    engine.release("c")
    assert engine.cache_bytes() == 0 and engine.active_requests == 0
    assert engine.pool.free_ranges == [(1, engine.pool.cells)]  # every cell back but the scratch cell


def test_a_cache_without_reservation_grows_and_keeps_its_contents(monkeypatch):
    monkeypatch.setattr("shards.engines.ggml.engine.MIN_CAPACITY", 4)
    tokens = np.random.default_rng(1).integers(0, 512, 30)
    reserved = chain_forward([make(LLAMA)], "r", tokens, all_logits=True)
    engine, pieces = make(LLAMA), []
    for chunk in np.split(tokens, [3, 4, 9, 20]):
        pieces.append(engine.forward([StepInput("r", tokens=chunk)], all_logits=True)[0])
    assert engine.caches["r"].capacity == 40  # 4, then doubled or the step's end when that is more: 9, 20, 40
    assert np.allclose(np.concatenate(pieces), reserved, atol=regrouped_atol("ggml"), rtol=0)


def test_many_requests_in_one_step_and_two_threads():
    engine, two = make(fixture("qwen3")), make(fixture("qwen3"))
    g.ggml_backend_cpu_set_n_threads(two.backend, 2)
    batch = [StepInput(f"r{i}", tokens=np.array([i + 1, i + 2])) for i in range(16)]
    outs = engine.forward(batch)
    assert np.array_equal(np.concatenate(outs), np.concatenate(two.forward(batch)))
    alone = make(fixture("qwen3")).forward([StepInput("x", tokens=np.array([8, 9]))])[0]
    assert np.allclose(outs[7], alone, atol=regrouped_atol("ggml"), rtol=0)


def test_inputs_ggml_would_abort_on_are_refused_and_the_engine_goes_on():
    engine = make(LLAMA, 0, 3)
    for bad in (np.array([512]), np.array([-1]), np.array([], dtype=np.int64), np.array([[1]])):
        with pytest.raises(EngineInputError):
            engine.forward([StepInput("r", tokens=bad)])
    with pytest.raises(EngineInputError):
        engine.forward([StepInput("r", tokens=np.zeros(257, dtype=np.int64))])  # beyond the model's 256 positions
    last = make(LLAMA, 3, 6)
    with pytest.raises(EngineInputError):
        last.forward([StepInput("r", hidden=np.zeros((2, 63), np.float32))])
    assert engine.forward([StepInput("r", tokens=np.array([1, 2]))])[0].shape == (2, 64)


# -- the pieces -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape,index,new",
    [
        ((6, 8), (slice(None), slice(2, 6)), (6, 2, 2)),
        ((6, 8), (slice(1, 4),), (3, 4, 2)),
        ((4, 3, 8), (slice(None), slice(None), slice(0, 4)), (4, 12)),
        ((4, 3, 8), (slice(None), slice(0, 2)), (8, 8)),
    ],
)
def test_reshape_views_follow_numpy(shape, index, new):
    a = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)[index]
    strides = nocopy_strides(a.shape, a.strides, new)
    try:
        view = a.view()
        view.shape = new  # numpy's no-copy reshape, or AttributeError when it needs a copy
    except AttributeError:
        assert strides is None
        return
    assert np.array_equal(np.lib.stride_tricks.as_strided(a, new, strides), view)


def test_a_model_with_repacked_weights_computes_what_the_plain_one_does():
    repacked, plain = make(fixture("qwen2")), make(fixture("qwen2"), repack=False)  # Q4_0 and Q4_K layers
    tokens = np.arange(1, 40)
    expected = chain_forward([plain], "r", tokens, all_logits=True)
    assert not plain.ops.repacked and (repacked.ops.repacked or not repack_supported(int(Q.Q4_0), (64, 64)))
    # the interleaved kernels quantize the activations the same way (observed: identical logits)
    assert np.allclose(chain_forward([repacked], "r", tokens, all_logits=True), expected, atol=1e-4, rtol=0)
