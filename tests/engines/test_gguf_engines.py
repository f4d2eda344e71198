"""Every installed engine runs GGUF models unchanged: logits within 1e-4 of transformers' GGUF loading, identical
greedy tokens (observed max |logit error| ~3e-5 for the numpy engine), and shard chains equal the whole model.

The ggml engine computes on the blocks themselves (the fixtures hold every supported weight type between them), so
its bounds are those of quantized math (tests/support/tolerance.py): RMS difference within 8% of the logits' spread and
teacher-forced top tokens instead of greedy equality."""

import numpy as np
import pytest

from shards.engines.registry import engine_class, installed
from shards.formats.loader import load_config
from shards.model.shard import Shard
from shards.reference.generate import chain_forward, generate
from tests.support.gguf_util import GGUF_MODELS, fixture, gguf_golden
from tests.support.tolerance import QUANTIZED_RMS, clear_top1_disagreements, exact, relative_rms


def make(engine_name: str, name: str, start: int = 0, end: int | None = None):
    cfg = load_config(fixture(name))
    return engine_class(engine_name)(fixture(name), Shard(name, start, end or cfg.n_layers, cfg.n_layers), cfg)


# The loader dequantizes a GGUF file's blocks to the same float32 arrays for every engine but ggml: tinygrad (whose
# every new shape costs kernel captures, ~7 s for qwen3 here) runs one GGUF model; numpy and mlx run them all on
# those arrays, and tinygrad's block on every fixture architecture is checked in tests/engines/test_engines.py.
@pytest.mark.parametrize(
    "engine_name, name",
    [(e, n) for e in installed() for n in GGUF_MODELS if e != "tinygrad" or n == GGUF_MODELS[0]],
)
def test_engine_matches_transformers_gguf_loading(engine_name, name):
    g = gguf_golden()["models"][name]
    engine = make(engine_name, name)
    logits = chain_forward([engine], "r", np.array(g["prompt_ids"]), all_logits=True)
    engine.release("r")
    reference = np.asarray(g["logits"], np.float32)
    if exact(engine_name):
        assert np.abs(logits - reference).max() < 1e-4
        assert [r.token for r in generate([engine], g["prompt_ids"], len(g["greedy_ids"]))] == g["greedy_ids"]
        return
    assert relative_rms(logits, reference) < QUANTIZED_RMS  # observed 2.6-4.0%
    # Teacher-forced along transformers' greedy sequence, against the numpy engine on the same (dequantized) weights
    sequence = np.array(g["prompt_ids"] + g["greedy_ids"][:-1])
    logits = chain_forward([engine], "r", sequence, all_logits=True)
    dequantized = chain_forward([make("numpy", name)], "r", sequence, all_logits=True)
    assert relative_rms(logits, dequantized) < QUANTIZED_RMS
    assert np.mean(logits.argmax(-1) == dequantized.argmax(-1)) >= 0.85  # observed 91-100%
    spread = QUANTIZED_RMS * dequantized.std()
    assert clear_top1_disagreements(logits, dequantized, 2 * spread)[0] == []


def test_a_split_gguf_model_equals_the_whole():
    g = gguf_golden()["models"]["llama"]
    chain = [make("numpy", "llama", a, b) for a, b in [(0, 1), (1, 3), (3, 4)]]
    whole = chain_forward([make("numpy", "llama")], "r", np.array(g["prompt_ids"]), all_logits=True)
    assert np.allclose(chain_forward(chain, "r", np.array(g["prompt_ids"]), all_logits=True), whole, atol=1e-6, rtol=0)
