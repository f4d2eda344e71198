"""Gemma 2 and Gemma 3 on the ggml engine: the window masks as a second graph input (shards/engines/ggml/sliding.py),
GeGLU, scales, soft-caps and the local layers' rope in the graph (shards/engines/ggml/gemma_ops.py), against
transformers and against llama.cpp on the same GGUFs."""

import numpy as np
import pytest

from shards.engines.registry import installed
from shards.engines.step import StepInput
from tests.engines.test_gemma import GEMMA, MODELS, SOURCES, golden, logits, make, model_of
from tests.support.tolerance import atol, clear_top1_disagreements, regrouped_atol

pytestmark = pytest.mark.skipif("ggml" not in installed(), reason="the ggml extra is not installed")


@pytest.mark.parametrize("source", SOURCES)
def test_logits_equal_transformers_and_shards_split_by_layers_equal_the_whole(source):
    """Three shards: a sliding layer alone (its graph reads no causal mask: the window masks replace it), then a
    mix, then the rest."""
    whole = logits([make("ggml", source)])
    assert np.abs(whole - golden()[f"{model_of(source)}.logits"]).max() < atol("ggml")  # observed 3.4e-3..6.3e-3
    n = len(make("ggml", source).model.layers)
    cuts = [0, 1, n // 2, n]
    split = logits([make("ggml", source, a, b) for a, b in zip(cuts, cuts[1:])])
    assert np.abs(split - whole).max() <= regrouped_atol("ggml")


@pytest.mark.parametrize("model", MODELS)
def test_ggml_computes_gemma_ggufs_as_llama_cpp_does(model):
    """llama.cpp's own logits on the same files (tests/fixtures/gemma/llamacpp.npz): its sliding windows, soft-caps,
    scales and local rope are what the flags say. They were computed on one CPU; another CPU's kernels sum the same
    F16 math in another order, so the bound is the engine's for the same positions summed in another order, and the
    top token must agree wherever llama.cpp's two best are further apart than twice that."""
    with np.load(GEMMA / "llamacpp.npz") as z:
        reference = z[model]
    got = logits([make("ggml", f"{model}.gguf")])
    bound = regrouped_atol("ggml")
    assert np.abs(got - reference).max() <= bound
    wrong, clear = clear_top1_disagreements(got, reference, 2 * bound)
    assert not wrong and clear >= len(reference) // 2


def test_a_prompt_in_chunks_equals_it_whole():
    """Chunks of 7 rows: each chunk's graph derives its window masks from its own causal masks."""
    prompt = golden()["prompt"]
    whole = logits([make("ggml", "gemma3.gguf")])
    engine = make("ggml", "gemma3.gguf")
    parts = [engine.forward([StepInput("r", tokens=prompt[i : i + 7])], all_logits=True)[0] for i in range(0, 24, 7)]
    assert np.abs(np.concatenate(parts) - whole).max() <= regrouped_atol("ggml")


def test_requests_batched_together_equal_their_solo_runs():
    """Two requests at different positions in one step: each row's window is cut from its own request's cells."""
    prompt = golden()["prompt"]
    a, b = prompt[:17], prompt[5:]

    def alone(tokens):
        return logits([make("ggml", "gemma2.gguf")], tokens)[-1]

    engine = make("ggml", "gemma2.gguf")
    engine.forward([StepInput("a", tokens=a[:-1]), StepInput("b", tokens=b[:-3])])
    engine.forward([StepInput("b", tokens=b[-3:-1])])
    out = engine.forward([StepInput("a", tokens=a[-1:]), StepInput("b", tokens=b[-1:])])
    assert np.abs(out[0][-1] - alone(a)).max() <= regrouped_atol("ggml")
    assert np.abs(out[1][-1] - alone(b)).max() <= regrouped_atol("ggml")


@pytest.mark.parametrize("model", MODELS)
def test_rows_attending_by_matmuls_keep_windows_and_caps_and_chunks_stay_exact(model, monkeypatch):
    """Past the pool's gemm_from a row attends by two F16 matmuls (shards/engines/ggml/attention.py): the window
    masks and Gemma 2's soft-capped scores hold there too (llama.cpp's logits within the same bound), and a prompt in
    chunks that straddle the boundary gives the logits of the whole, bit for bit."""
    from shards.engines.ggml import attention

    monkeypatch.setattr(attention, "GEMM_FROM", 10)
    whole = logits([make("ggml", f"{model}.gguf")])
    with np.load(GEMMA / "llamacpp.npz") as z:
        assert np.abs(whole - z[model]).max() <= regrouped_atol("ggml")
    engine = make("ggml", f"{model}.gguf")
    assert engine.pool.gemm_from == 10
    prompt = golden()["prompt"]
    parts = [engine.forward([StepInput("r", tokens=prompt[i : i + 7])], all_logits=True)[0] for i in range(0, 24, 7)]
    assert np.array_equal(np.concatenate(parts), whole)
