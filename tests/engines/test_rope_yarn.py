"""YaRN rope scaling (Qwen2.5/Qwen3 long-context configs), from a Hugging Face config and from GGUF metadata, on
every engine. Reference: transformers on tests/fixtures/llama with YaRN in its config (tests/fixtures/llama_yarn.npz,
made by make_yarn_reference.py, which also records the rope keys llama.cpp's converter writes for that folder; the
GGUF here is llama31.gguf, the same bf16 weights, with those keys instead of rope_freqs.weight).

Bounds: float engines 1e-4; ggml (float32 weights from the folder: F16 KV cache; bf16 blocks from the GGUF: bf16
activations) as in tests/support/tolerance.py."""

import json
import shutil
from dataclasses import replace

import gguf
import numpy as np
import pytest

from shards.engines.registry import engine_class, installed
from shards.formats.loader import load_config
from shards.model.shard import Shard
from shards.reference.generate import chain_forward
from tests.support.gguf_util import GGUF_DIR, rewrite
from tests.support.models import FIXTURES
from tests.support.tolerance import QUANTIZED_RMS, atol, exact, relative_rms

REFERENCE = np.load(FIXTURES / "llama_yarn.npz")
TOKENS, LOGITS = REFERENCE["tokens"], REFERENCE["logits"]
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 4.0,
    "beta_slow": 1.0,
}  # make_yarn_reference.YARN


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    dst = tmp_path_factory.mktemp("yarn") / "llama-yarn"
    shutil.copytree(FIXTURES / "llama", dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"] = YARN
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    V = gguf.GGUFValueType
    kinds = {str: V.STRING, float: V.FLOAT32, int: V.UINT32}
    keys = {k: (v, kinds[type(v)]) for k, v in json.loads(str(REFERENCE["gguf_rope"])).items()}
    return rewrite(
        GGUF_DIR / "llama31.gguf",
        tmp_path_factory.mktemp("yarn") / "llama-yarn.gguf",
        replace=keys,
        drop_tensors=("rope_freqs.weight",),
    )


def run(engine_name, path, cfg=None):
    cfg = cfg or load_config(path)
    options = {"threads": 1} if engine_name == "ggml" else {}
    engine = engine_class(engine_name)(path, Shard("y", 0, cfg.n_layers, cfg.n_layers), cfg, **options)
    return chain_forward([engine], "r", TOKENS, all_logits=True)


@pytest.mark.parametrize("engine_name", installed())
def test_every_engine_matches_transformers_on_the_folder(folder, engine_name):
    logits = run(engine_name, folder)
    assert np.abs(logits - LOGITS).max() < atol(engine_name)


@pytest.mark.parametrize("engine_name", installed())
def test_every_engine_matches_transformers_on_the_gguf(gguf_file, folder, engine_name):
    a, b = load_config(gguf_file).rope, load_config(folder).rope
    assert a.kind == b.kind == "yarn" and a.attention_factor == pytest.approx(b.attention_factor, rel=1e-7)
    assert a.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    np.testing.assert_allclose(a.inv_freq(16), b.inv_freq(16), rtol=1e-7)
    logits = run(engine_name, gguf_file)
    if exact(engine_name):
        assert np.abs(logits - LOGITS).max() < 1e-4
    else:
        assert relative_rms(logits, LOGITS) < QUANTIZED_RMS


def test_the_reference_tells_yarn_from_its_parts(folder):
    """Without the attention factor, or without the ramp (plain linear interpolation), the logits miss."""
    cfg = load_config(folder)
    no_factor = replace(cfg, rope=replace(cfg.rope, yarn_attention_factor=1.0))
    linear = replace(cfg, rope=replace(cfg.rope, kind="linear"))
    for wrong in (no_factor, linear):
        assert np.abs(run("numpy", folder, wrong) - LOGITS).max() > 1e-2
