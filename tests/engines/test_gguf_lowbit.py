"""The low-bit weight types of common downloads (Q2_K, Q3_K, IQ4_NL, IQ4_XS, IQ3_XXS, IQ3_S, IQ2_XXS/XS/S, IQ1_S/M,
TQ1_0/TQ2_0, MXFP4) on every engine: ggml computes on their blocks natively, the float engines on gguf-py's
dequantization. tests/fixtures/gguf/lowbit.gguf (make_gguf_lowbit.py) holds one matrix of each type, quantized by
llama.cpp's own code; lowbit_llamacpp.npz is llama.cpp's logits on it, teacher-forced over lowbit_tokens.json.

Bounds: ggml against llama.cpp (fed in batches of 32 rows, as the engine attends), RMS within 1% of the logits'
spread (observed 0.30%: llama.cpp's newer ggml sums some ops in another order) and top-1 agreement >= 99% (observed
100%, 64 positions); float engines against llama.cpp, quantized math's bound (tests/support/tolerance.py; observed
2.8%) with no clear top-1 disagreement."""

import json

import numpy as np
import pytest

from shards.engines.registry import engine_class, installed
from shards.formats.gguf_file import open_gguf
from shards.formats.loader import load_config
from shards.formats.quant import LOW_BIT_TYPES
from shards.model.shard import Shard
from shards.reference.generate import chain_forward
from tests.support.gguf_util import GGUF_DIR
from tests.support.tolerance import QUANTIZED_RMS, clear_top1_disagreements, relative_rms

LOWBIT = GGUF_DIR / "lowbit.gguf"
LLAMACPP_RMS, LLAMACPP_TOP1 = 0.01, 0.99


def tokens() -> np.ndarray:
    return np.array(json.loads((GGUF_DIR / "lowbit_tokens.json").read_text()))


def llama_cpp() -> np.ndarray:
    return np.load(GGUF_DIR / "lowbit_llamacpp.npz")["logits"]


def run(engine_name: str, *ranges: tuple[int, int]) -> np.ndarray:
    cfg = load_config(LOWBIT)
    options = {"threads": 1} if engine_name == "ggml" else {}
    ranges = ranges or ((0, cfg.n_layers),)
    chain = [engine_class(engine_name)(LOWBIT, Shard("lb", a, b, cfg.n_layers), cfg, **options) for a, b in ranges]
    return chain_forward(chain, "r", tokens(), all_logits=True)


def test_the_fixture_holds_every_low_bit_type():
    types = {info.ggml_type for info in open_gguf(LOWBIT).tensors.values()}
    assert set(LOW_BIT_TYPES) <= types


@pytest.mark.skipif("ggml" not in installed(), reason="the ggml engine is not installed")
def test_ggml_computes_as_llama_cpp_does():
    logits, reference = run("ggml"), llama_cpp()
    assert relative_rms(logits, reference) < LLAMACPP_RMS
    assert np.mean(logits.argmax(-1) == reference.argmax(-1)) >= LLAMACPP_TOP1


@pytest.mark.parametrize("engine_name", [e for e in installed() if e != "ggml"])
def test_float_engines_compute_on_the_dequantized_blocks(engine_name):
    logits, reference = run(engine_name), llama_cpp()
    assert relative_rms(logits, reference) < QUANTIZED_RMS
    assert clear_top1_disagreements(logits, reference, 2 * QUANTIZED_RMS * reference.std())[0] == []


@pytest.mark.parametrize("engine_name", [e for e in ("ggml", "numpy") if e in installed()])
def test_two_shards_equal_the_whole(engine_name):
    assert np.allclose(run(engine_name, (0, 1), (1, 2)), run(engine_name), atol=1e-4, rtol=0)
