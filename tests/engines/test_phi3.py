"""Phi-3: the Llama block with q/k/v and gate/up stored fused, read apart (shards/formats/fused_layout.py) so every
engine runs it unchanged; a tiny random checkpoint by transformers (tests/fixtures/make_moe_reference.py) and the
GGUF llama.cpp's converter made of it (make_phi3_gguf.py: `attn_qkv`, and `ffn_up` holding gate and up)."""

import dataclasses
import json

import numpy as np
import pytest

from shards.engines.registry import engine_class, installed
from shards.formats.config import ConfigError, ModelConfig
from shards.formats.loader import load_config
from shards.model.shard import Shard
from shards.reference.generate import chain_forward, generate
from tests.support.models import FIXTURES
from tests.support.tolerance import atol, exact, regrouped_atol

PHI3 = FIXTURES / "moe" / "phi3"
GOLDEN = json.loads((FIXTURES / "moe" / "golden.json").read_text())["phi3"]
RAW = json.loads((PHI3 / "config.json").read_text())


def make(engine: str, start: int = 0, end: int = 3, source=PHI3):
    cfg = load_config(source)
    return engine_class(engine)(source, Shard("phi3", start, end, cfg.n_layers), cfg)


# numpy and ggml: what is Phi-3's own is in the loader, engine-agnostic (tinygrad's captures cost a minute here)
@pytest.mark.parametrize("source", [PHI3, PHI3.with_suffix(".gguf")], ids=["folder", "gguf"])
@pytest.mark.parametrize("engine", [e for e in ("numpy", "ggml") if e in installed()])
def test_logits_equal_transformers_and_three_shards_equal_one(engine, source):
    prompt = np.array(GOLDEN["prompt_ids"])
    logits = chain_forward([make(engine, source=source)], "r", prompt, all_logits=True)
    assert np.abs(logits - np.asarray(GOLDEN["logits"], np.float32)).max() < atol(engine)  # observed 3e-6 / 8e-3
    split = chain_forward([make(engine, i, i + 1, source) for i in range(3)], "r", prompt, all_logits=True)
    assert np.abs(split - logits).max() <= regrouped_atol(engine)
    if exact(engine):
        tokens = [r.token for r in generate([make(engine, source=source)], GOLDEN["prompt_ids"], 16)]
        assert tokens == GOLDEN["greedy_ids"]


def test_a_gguf_says_what_its_folder_says():
    """Its sliding window caps the context as the folder's does; its fused tensors are read as the same rows."""
    gguf, folder = load_config(PHI3.with_suffix(".gguf")), ModelConfig.from_dir(PHI3)
    assert dataclasses.replace(gguf, rms_norm_eps=folder.rms_norm_eps) == folder  # (eps: float32 in a GGUF)


@pytest.mark.parametrize("source", [PHI3, PHI3.with_suffix(".gguf")], ids=["folder", "gguf"])
@pytest.mark.parametrize("engine", [e for e in ("numpy", "ggml") if e in installed()])
def test_every_layer_attends_within_the_sliding_window_as_in_transformers(tmp_path, engine, source):
    """With its window (8) shorter than the prompt (12), transformers' logits (tests/fixtures/make_phi3_window.py)."""
    cfg = load_config(source)
    assert cfg.block.sliding.size == 128 and cfg.block.sliding.layers == {0, 1, 2}
    assert cfg.max_position_embeddings == 256  # the window is a mask: the context is the model's
    windowed = dataclasses.replace(
        cfg, block=dataclasses.replace(cfg.block, sliding=dataclasses.replace(cfg.block.sliding, size=8))
    )
    with np.load(FIXTURES / "moe" / "phi3_window8.npz") as z:
        prompt, reference = z["prompt"], z["logits"]
    engine_ = engine_class(engine)(source, Shard.whole("w", cfg.n_layers), windowed)
    got = chain_forward([engine_], "r", prompt, all_logits=True)
    assert np.abs(got - reference).max() < atol(engine)
    assert ModelConfig.from_dict(RAW | {"sliding_window": None}).block.sliding is None


def test_partial_rotary_and_longrope_are_refused_naming_them():
    with pytest.raises(ConfigError, match="partial rotary embeddings"):
        ModelConfig.from_dict(RAW | {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}})
    with pytest.raises(ConfigError, match="longrope"):
        ModelConfig.from_dict(RAW | {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})
