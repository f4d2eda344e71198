"""A Llama 3.1-style GGUF as people download it: llama.cpp's converter writes the llama3 rope scaling as a
`rope_freqs.weight` tensor of per-pair factors (tests/fixtures/gguf/llama31.gguf, made by make_gguf_converted.py
from tests/fixtures/llama, bf16, so the weights are the folder's bit for bit). Every engine must compute what
transformers computed on the folder (tests/fixtures/llama/golden.json).

Bounds (tests/support/tolerance.py): float engines 1e-4 and identical greedy tokens; ggml on bf16 weights rounds
activations to bf16 for its matmuls, so the quantized bound (RMS within 8% of the logits' spread) and teacher-forced
top-1 agreement with the numpy engine on the same file."""

import numpy as np
import pytest

from shards.engines.registry import engine_class, installed
from shards.formats.loader import load_config
from shards.model.shard import Shard
from shards.reference.generate import chain_forward, generate
from tests.support.gguf_util import GGUF_DIR
from tests.support.models import FIXTURES, golden
from tests.support.tolerance import QUANTIZED_RMS, clear_top1_disagreements, exact, relative_rms

LLAMA31 = GGUF_DIR / "llama31.gguf"


def make(engine_name: str, start: int = 0, end: int | None = None):
    cfg = load_config(LLAMA31)
    return engine_class(engine_name)(LLAMA31, Shard("l31", start, end or cfg.n_layers, cfg.n_layers), cfg)


def test_rope_freqs_are_read_as_the_llama3_scaling_of_the_folder():
    gguf_cfg, hf_cfg = load_config(LLAMA31), load_config(FIXTURES / "llama")
    assert hf_cfg.rope.kind == "llama3" and gguf_cfg.rope.kind == "factors"
    assert len(gguf_cfg.rope.freq_factors) == gguf_cfg.head_dim // 2
    assert len(set(gguf_cfg.rope.freq_factors)) > 2  # high, smoothed and low bands: the test can tell them apart
    np.testing.assert_allclose(
        gguf_cfg.rope.inv_freq(gguf_cfg.head_dim), hf_cfg.rope.inv_freq(hf_cfg.head_dim), rtol=1e-6
    )


@pytest.mark.parametrize("engine_name", installed())
def test_every_engine_matches_transformers_on_the_converted_file(engine_name):
    g = golden("llama")
    engine = make(engine_name)
    logits = chain_forward([engine], "r", np.array(g["prompt_ids"]), all_logits=True)
    engine.release("r")
    reference = np.asarray(g["logits"], np.float32)
    if exact(engine_name):
        assert np.abs(logits - reference).max() < 1e-4
        assert [r.token for r in generate([engine], g["prompt_ids"], len(g["greedy_ids"]))] == g["greedy_ids"]
        return
    assert relative_rms(logits, reference) < QUANTIZED_RMS
    sequence = np.array(g["prompt_ids"] + g["greedy_ids"][:-1])
    logits = chain_forward([engine], "r", sequence, all_logits=True)
    dequantized = chain_forward([make("numpy")], "r", sequence, all_logits=True)
    assert relative_rms(logits, dequantized) < QUANTIZED_RMS
    assert clear_top1_disagreements(logits, dequantized, 2 * QUANTIZED_RMS * dequantized.std())[0] == []


def test_without_the_factors_the_model_would_compute_something_else():
    """The reference can fail: the same file read with plain rope (no factors) misses transformers' logits."""
    from dataclasses import replace

    from shards.formats.config import RopeConfig

    cfg = load_config(LLAMA31)
    plain = replace(cfg, rope=RopeConfig(theta=cfg.rope.theta))
    engine = engine_class("numpy")(LLAMA31, Shard("l31", 0, cfg.n_layers, cfg.n_layers), plain)
    g = golden("llama")
    logits = chain_forward([engine], "r", np.array(g["prompt_ids"]), all_logits=True)
    assert np.abs(logits - np.asarray(g["logits"], np.float32)).max() > 1e-2


def test_three_shards_of_the_file_equal_the_whole():
    g = golden("llama")
    chain = [make("numpy", a, b) for a, b in [(0, 2), (2, 4), (4, 6)]]
    whole = chain_forward([make("numpy")], "r", np.array(g["prompt_ids"]), all_logits=True)
    assert np.allclose(chain_forward(chain, "r", np.array(g["prompt_ids"]), all_logits=True), whole, atol=1e-6)
