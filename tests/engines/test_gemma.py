"""Gemma 2 and Gemma 3 (text) in the one shared block: GeGLU, four norms per block, scaled embeddings, soft-capped
attention scores and logits, and sliding-window layers (Gemma 3's with their own rotary base), from Hugging Face
folders and from the GGUFs llama.cpp's converter made of them (tests/fixtures/make_gemma_reference.py). The prompt
is 24 tokens and the window 5: the window hides most of the cache from every sliding layer, so a window computed
wrong (or not at all) shows in the logits."""

import dataclasses
import json
import shutil
from functools import cache

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from shards.engines.registry import engine_class
from shards.engines.step import StepInput
from shards.formats.config import ModelConfig
from shards.formats.loader import load_config
from shards.model.shard import Shard
from shards.reference.generate import chain_forward, generate
from tests.support.models import FIXTURES
from tests.support.tolerance import atol, regrouped_atol

GEMMA = FIXTURES / "gemma"
MODELS = ["gemma2", "gemma3"]
SOURCES = [f"{m}{ext}" for m in MODELS for ext in ("", ".gguf")]  # HF folder, its F16 GGUF (the same values)
ENGINES = ["numpy"]  # tinygrad runs Gemma eagerly, the same block: not here, its kernels compile for a minute


@cache
def golden() -> dict[str, np.ndarray]:
    with np.load(GEMMA / "golden.npz") as z:
        return {k: z[k] for k in z.files}


def model_of(source: str) -> str:
    return source.removesuffix(".gguf")


def make(engine: str, source, start: int = 0, end: int | None = None, cfg: ModelConfig | None = None):
    cfg = cfg or load_config(GEMMA / source)
    return engine_class(engine)(GEMMA / source, Shard("g", start, end or cfg.n_layers, cfg.n_layers), cfg)


def logits(engines, prompt=None) -> np.ndarray:
    return chain_forward(engines, "r", golden()["prompt"] if prompt is None else prompt, all_logits=True)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("engine", ENGINES)
def test_logits_equal_transformers_and_shards_split_by_layers_equal_the_whole(engine, source):
    whole = logits([make(engine, source)])
    reference = golden()[f"{model_of(source)}.logits"]
    assert np.abs(whole - reference).max() < atol(engine)  # observed numpy <= 3e-6
    n = load_config(GEMMA / source).n_layers
    cuts = [0, 1, n // 2, n]  # three shards: a sliding layer alone, then the rest in two
    split = logits([make(engine, source, a, b) for a, b in zip(cuts, cuts[1:])])
    assert np.abs(split - whole).max() <= regrouped_atol(engine)


@pytest.mark.parametrize("source", SOURCES)
def test_greedy_decoding_far_past_the_window_equals_transformers(source):
    """16 tokens decoded one at a time after 24 prompt tokens: every decode step's window mask hides all but the
    last 5 positions (a single row is no longer 'sees everything')."""
    prompt = golden()["prompt"].tolist()
    tokens = [r.token for r in generate([make("numpy", source)], prompt, 16)]
    assert tokens == golden()[f"{model_of(source)}.greedy"].tolist()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_prompt_in_chunks_equals_it_whole(engine):
    """Chunks of 7 rows cross the window's edge at different places than the whole prompt's rows do."""
    prompt = golden()["prompt"]
    whole = logits([make(engine, "gemma3")])
    chunked = make(engine, "gemma3")
    parts = [chunked.forward([StepInput("r", tokens=prompt[i : i + 7])], all_logits=True)[0] for i in range(0, 24, 7)]
    assert np.abs(np.concatenate(parts) - whole).max() <= regrouped_atol(engine)


@pytest.mark.parametrize("feature", ["sliding", "attn_softcap", "final_softcap"])
def test_each_gemma_feature_changes_the_logits(feature):
    """The fixture is made so that each feature matters: without it, the logits are far from transformers'."""
    cfg = load_config(GEMMA / "gemma2")
    without = dataclasses.replace(cfg, block=dataclasses.replace(cfg.block, **{feature: None}))
    assert np.abs(logits([make("numpy", "gemma2", cfg=without)]) - golden()["gemma2.logits"]).max() > 0.05


def test_query_pre_attn_scalar_sets_the_attention_scale(tmp_path):
    """Gemma scales q.k by query_pre_attn_scalar^-0.5, not head_dim^-0.5: the same weights with 64 instead of 16
    give transformers' logits for 64."""
    folder = shutil.copytree(GEMMA / "gemma2", tmp_path / "gemma2")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | {"query_pre_attn_scalar": 64}))
    cfg = ModelConfig.from_dir(folder)
    got = chain_forward(
        [engine_class("numpy")(folder, Shard.whole("q", cfg.n_layers), cfg)], "r", golden()["prompt"], all_logits=True
    )
    assert np.abs(got - golden()["gemma2_qscale.logits"]).max() < 1e-4
    assert np.abs(got - golden()["gemma2.logits"]).max() > 0.05


@pytest.mark.parametrize(
    "prefix", ["model.language_model.", "language_model.model."], ids=["transformers5", "transformers4"]
)
def test_gemma3_with_its_vision_tower_runs_its_language_model(tmp_path, prefix):
    """A Gemma3ForConditionalGeneration folder (Gemma 3 4B and up): the text_config over Gemma3TextConfig's defaults,
    the language model's tensors under either transformers' prefix, the vision tower never read."""
    raw = json.loads((GEMMA / "gemma3" / "config.json").read_text())
    text = {k: v for k, v in raw.items() if k not in ("architectures", "hidden_activation", "rms_norm_eps", "dtype")}
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "dtype": "float16",
        "text_config": text,
        "vision_config": {"hidden_size": 8},
    }
    with safe_open(GEMMA / "gemma3" / "model.safetensors", framework="numpy") as f:
        tensors = {prefix + k.removeprefix("model."): f.get_tensor(k) for k in f.keys()}
    tensors["model.vision_tower.patch_embedding.weight"] = np.zeros((8, 3), np.float16)
    folder = tmp_path / "gemma3mm"
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_dir(folder)
    assert cfg == ModelConfig.from_dir(GEMMA / "gemma3")
    got = chain_forward(
        [engine_class("numpy")(folder, Shard.whole("m", cfg.n_layers), cfg)], "r", golden()["prompt"], all_logits=True
    )
    assert np.abs(got - golden()["gemma3.logits"]).max() < atol("numpy")
