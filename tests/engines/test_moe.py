"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) on every engine that runs them, from
Hugging Face folders (per-expert and transformers 5's fused layout) and from the GGUFs llama.cpp's converter made
of them (tests/fixtures/make_moe_reference.py): logits equal transformers', shards split by layers equal the whole
model, and requests routed to different experts in one batch equal their solo runs."""

import json
from functools import cache

import numpy as np
import pytest

from shards.engines.base import StepInput
from shards.engines.moe_backend import top_experts
from shards.engines.numpy_engine import NumpyBackend
from shards.engines.registry import engine_class, engine_factory, installed
from shards.formats.loader import load_config
from shards.formats.moe_layout import stacked_sources
from shards.model.moe import MOE_ENGINES, UnsupportedMoE
from shards.model.shard import Shard
from shards.reference.generate import chain_forward, generate
from tests.support.models import FIXTURES
from tests.support.tolerance import QUANTIZED_RMS, atol, exact, regrouped_atol, relative_rms

MOE = FIXTURES / "moe"
MODELS = ["qwen3moe", "qwen2moe", "mixtral"]
SOURCES = [f"{m}{ext}" for m in MODELS for ext in ("", ".gguf")]  # HF folder, its F16 GGUF (the same values)
ENGINES = [e for e in MOE_ENGINES if e in installed()]


@cache
def golden(model: str) -> dict:
    return json.loads((MOE / "golden.json").read_text())[model]


def make(engine: str, source: str, start: int = 0, end: int | None = None):
    cfg = load_config(MOE / source)
    return engine_class(engine)(MOE / source, Shard(source, start, end or cfg.n_layers, cfg.n_layers), cfg)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("engine", ENGINES)
def test_logits_equal_transformers(engine, source):
    g = golden(source.split(".")[0])
    logits = chain_forward([make(engine, source)], "r", np.array(g["prompt_ids"]), all_logits=True)
    assert np.abs(logits - np.asarray(g["logits"], np.float32)).max() < atol(engine)  # observed 3e-6 / 7e-3 (ggml)
    if exact(engine):
        assert [r.token for r in generate([make(engine, source)], g["prompt_ids"], 16)] == g["greedy_ids"]


@pytest.mark.parametrize("source", ["qwen3moe.gguf", "qwen2moe", "mixtral.gguf"])
@pytest.mark.parametrize("engine", ENGINES)
def test_three_shards_equal_the_whole_model(engine, source):
    g = golden(source.split(".")[0])
    prompt = np.array(g["prompt_ids"])
    whole = chain_forward([make(engine, source)], "r", prompt, all_logits=True)
    split = chain_forward([make(engine, source, i, i + 1) for i in range(3)], "r", prompt, all_logits=True)
    assert np.abs(whole - split).max() <= (0 if engine == "numpy" else regrouped_atol(engine))


@pytest.mark.parametrize("engine", ENGINES)
def test_concurrent_requests_routed_to_different_experts_equal_their_solo_runs(engine):
    g = golden("qwen3moe")
    prompts = [g["prompt_ids"], g["prompt_ids"][3:9], g["greedy_ids"][:5]]
    solo = []
    for i, p in enumerate(prompts):
        e = make(engine, "qwen3moe.gguf")
        solo.append(e.forward([StepInput(f"r{i}", tokens=np.array(p))])[0])
    e = make(engine, "qwen3moe.gguf")
    together = e.forward([StepInput(f"r{i}", tokens=np.array(p)) for i, p in enumerate(prompts)])
    for a, b in zip(solo, together):
        assert np.abs(a - b).max() <= regrouped_atol(engine)


def test_the_batch_does_route_rows_to_different_experts():
    """What the test above relies on: its rows do not all pick the same experts."""
    g = golden("qwen3moe")
    e = make("numpy", "qwen3moe")
    x = e.model.ops.embedding(e.model.embed_tokens, np.array(g["prompt_ids"] + g["greedy_ids"][:5]))
    layer = e.model.layers[0]
    ids, _ = top_experts(layer.mlp.ops.linear(layer.post_attention_layernorm(x), layer.mlp.gate), 2, True)
    assert len(np.unique(ids)) >= 6


def test_routing_picks_the_top_k_and_renormalises_only_when_asked():
    logits = np.log(np.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]], np.float32))
    ids, w = top_experts(logits, 2, normalize=False)
    assert ids.tolist() == [[1, 2], [0, 2]] and np.allclose(w, [[0.6, 0.3], [0.5, 0.3]])
    _, w = top_experts(logits, 2, normalize=True)
    assert np.allclose(w, [[2 / 3, 1 / 3], [0.625, 0.375]])


def test_each_row_gets_only_its_experts_weighted_outputs():
    ops = NumpyBackend()
    rng = np.random.default_rng(0)
    gate, up, down = rng.normal(size=(4, 8, 6)), rng.normal(size=(4, 8, 6)), rng.normal(size=(4, 6, 8))
    x, logits = rng.normal(size=(5, 6)).astype(np.float32), rng.normal(size=(5, 4)).astype(np.float32)
    out = ops.moe(x, logits, ops.experts(gate, up, down), 2, True)
    ids, w = top_experts(logits, 2, True)
    for r in range(5):
        expected = sum(
            w[r, j] * down[e] @ (x[r] @ gate[e].T / (1 + np.exp(-x[r] @ gate[e].T)) * (x[r] @ up[e].T))
            for j, e in enumerate(ids[r])
        )
        assert np.allclose(out[r], expected, atol=1e-4)


@pytest.mark.skipif("ggml" not in installed(), reason="the ggml extra is not installed")
def test_ggml_on_q8_0_experts_stays_close_to_the_same_weights_in_float():
    """The experts stay in their Q8_0 blocks (ggml_mul_mat_id); the numpy engine dequantizes the same file."""
    g = golden("qwen3moe")
    sequence = np.array(g["prompt_ids"] + g["greedy_ids"][:-1])
    quantized = chain_forward([make("ggml", "qwen3moe.q8_0.gguf")], "r", sequence, all_logits=True)
    dequantized = chain_forward([make("numpy", "qwen3moe.q8_0.gguf")], "r", sequence, all_logits=True)
    assert relative_rms(quantized, dequantized) < QUANTIZED_RMS
    assert (quantized.argmax(-1) == dequantized.argmax(-1)).mean() >= 0.9


def test_ggml_keeps_the_experts_in_their_file_types():
    if "ggml" not in installed():
        pytest.skip("the ggml extra is not installed")
    q8, f16 = make("ggml", "qwen3moe.q8_0.gguf"), make("ggml", "qwen3moe.gguf")
    assert q8.nbytes() < 0.6 * f16.nbytes()  # Q8_0: 34 bytes per 32 values, F16: 64


@pytest.mark.parametrize("engine", [e for e in installed() if e not in MOE_ENGINES])
def test_engines_without_moe_refuse_naming_the_engines_that_can(engine):
    with pytest.raises(UnsupportedMoE, match="mixture of experts.*--engine ggml, numpy, mlx"):
        make(engine, "qwen3moe")
    with pytest.raises(UnsupportedMoE, match=f"the {engine} engine does not run"):  # at start-up, before any load
        engine_factory(engine, MOE / "qwen3moe.gguf")


def test_the_three_checkpoint_layouts_give_the_same_stacked_experts():
    per_expert = {f"model.layers.0.mlp.experts.{e}.{k}_proj.weight" for e in range(2) for k in ("gate", "up")}
    mixtral = {f"model.layers.0.block_sparse_moe.experts.{e}.w{k}.weight" for e in range(2) for k in (1, 3)}
    fused = {"model.layers.0.mlp.experts.gate_up_proj"}
    name, shape = "model.layers.0.mlp.experts.up_proj", (2, 3, 4)
    for names, read in [
        (per_expert, {"model.layers.0.mlp.experts.1.up_proj.weight"}),
        (mixtral, {"model.layers.0.block_sparse_moe.experts.0.w3.weight"}),
        (fused, fused),
    ]:
        parts, combine = stacked_sources(name, shape, names.__contains__)
        assert read <= set(parts)
    stacked = np.arange(2 * 6 * 4).reshape(2, 6, 4)
    parts, combine = stacked_sources(name, shape, fused.__contains__)
    assert np.array_equal(combine({"model.layers.0.mlp.experts.gate_up_proj": stacked}), stacked[:, 3:])
    assert stacked_sources(name, shape, lambda n: False) is None


def test_ggml_quantizes_a_checkpoints_experts_on_load_as_llama_cpp_does():
    """--quantize q8_0 on the Hugging Face folder: the same Q8_0 blocks as llama.cpp's converter wrote, routers
    kept in float32 (as in the file), so the same logits."""
    if "ggml" not in installed():
        pytest.skip("the ggml extra is not installed")
    cfg = load_config(MOE / "qwen3moe")
    prompt = np.array(golden("qwen3moe")["prompt_ids"])
    on_load = engine_class("ggml")(MOE / "qwen3moe", Shard("q", 0, 3, 3), cfg, quantize="q8_0")
    converted = make("ggml", "qwen3moe.q8_0.gguf")
    assert np.array_equal(chain_forward([on_load], "r", prompt), chain_forward([converted], "r", prompt))
