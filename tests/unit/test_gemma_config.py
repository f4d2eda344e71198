"""Gemma 2 and Gemma 3's block flags (shards/formats/block_config.py) from config.json and from GGUF metadata as
llama.cpp reads it, and the refusals that remain."""

import json

import pytest
from gguf import GGUFValueType as V

from shards.formats.block_config import embed_scale
from shards.formats.config import ConfigError, ModelConfig
from shards.formats.gguf_file import GGUFError
from shards.formats.loader import load_config
from tests.support.gguf_util import rewrite
from tests.support.models import FIXTURES

GEMMA = FIXTURES / "gemma"


def raw(name: str) -> dict:
    return json.loads((GEMMA / name / "config.json").read_text())


def test_gemma2_alternates_sliding_and_global_layers_and_soft_caps():
    b = ModelConfig.from_dir(GEMMA / "gemma2").block
    assert (b.activation, b.sandwich_norms, b.norm_offset) == ("gelu_tanh", True, 1.0)
    assert b.sliding.size == 5 and b.sliding.layers == {0, 2} and b.sliding.rope is None
    assert (b.attn_softcap, b.final_softcap, b.query_scale) == (4.0, 6.0, 0.25)


def test_gemma3_has_five_local_layers_to_one_global_each_with_its_own_rope_base():
    cfg = ModelConfig.from_dir(GEMMA / "gemma3")
    assert cfg.qk_norm and cfg.rope.theta == 1e6 and cfg.block.attn_softcap is None
    assert cfg.block.sliding.layers == {0, 1, 2, 3, 4} and cfg.block.sliding.rope.theta == 1e4


def test_older_gemma3_configs_name_the_pattern_and_the_local_base():
    old = {
        k: v for k, v in raw("gemma3").items() if k not in ("layer_types", "rope_parameters", "_sliding_window_pattern")
    }
    cfg = ModelConfig.from_dict(
        old | {"num_hidden_layers": 8, "sliding_window_pattern": 4, "rope_theta": 5e5, "rope_local_base_freq": 2e3}
    )
    assert cfg.block.sliding.layers == {0, 1, 2, 4, 5, 6} and cfg.rope.theta == 5e5
    assert cfg.block.sliding.rope.theta == 2e3


def test_a_gguf_says_what_its_folder_says_but_the_norm_offset_the_converter_applied():
    for name in ("gemma2", "gemma3"):
        hf, gguf = ModelConfig.from_dir(GEMMA / name), load_config(GEMMA / f"{name}.gguf")
        assert gguf.block.norm_offset == 0.0 and hf.block.norm_offset == 1.0
        assert gguf.block == type(hf.block)(**{**hf.block.__dict__, "norm_offset": 0.0})
        assert (gguf.rope, gguf.qk_norm) == (hf.rope, hf.qk_norm)


def test_fields_a_config_leaves_out_take_transformers_defaults_and_an_explicit_null_stays_off():
    omitted = ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "query_pre_attn_scalar")
    b = ModelConfig.from_dict({k: v for k, v in raw("gemma2").items() if k not in omitted}).block
    assert (b.attn_softcap, b.final_softcap, b.sliding.size, b.query_scale) == (50.0, 30.0, 4096, 256**-0.5)
    b = ModelConfig.from_dict(raw("gemma2") | {k: None for k in omitted}).block
    assert (b.attn_softcap, b.final_softcap, b.sliding, b.query_scale) == (None, None, None, None)


def test_the_embedding_scale_is_rounded_as_transformers_rounds_it():
    """In the activations' dtype: bfloat16 for Gemma's published checkpoints; float32 otherwise (and in llama.cpp)."""
    assert embed_scale(3072, "bfloat16") == 55.5 and abs(embed_scale(3072, "float32") - 55.4256) < 1e-4
    assert embed_scale(2304, "bfloat16") == 48.0


def test_gguf_sliding_window_pattern_and_default_window(tmp_path):
    path = rewrite(
        GEMMA / "gemma3.gguf", tmp_path / "p.gguf", replace={"gemma3.attention.sliding_window_pattern": (3, V.UINT32)}
    )
    assert load_config(path).block.sliding.layers == {0, 1, 3, 4}
    path = rewrite(GEMMA / "gemma2.gguf", tmp_path / "w.gguf", drop=("gemma2.attention.sliding_window",))
    assert load_config(path).block.sliding.size == 4096  # llama.cpp's Gemma 2 default


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
        ({"use_bidirectional_attention": True}, "bidirectional attention"),
        ({"layer_types": ["sliding_attention"]}, "layer_types must list"),
        ({"final_logit_softcapping": -1}, "final_logit_softcapping must be a positive number"),
    ],
)
def test_bad_gemma_fields_are_refused_naming_them(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw("gemma2") | change)


def test_gpt_oss_is_refused_naming_what_it_needs(tmp_path):
    path = rewrite(GEMMA / "gemma2.gguf", tmp_path / "o.gguf", replace={"general.architecture": ("gpt-oss", V.STRING)})
    with pytest.raises(GGUFError, match="gpt-oss needs attention sinks"):
        load_config(path)


def test_mistral_v01_attends_within_its_window_in_every_layer_as_transformers_does():
    base = json.loads((FIXTURES / "llama" / "config.json").read_text()) | {"architectures": ["MistralForCausalLM"]}
    cfg = ModelConfig.from_dict(base | {"sliding_window": 4096})
    assert cfg.block.sliding.size == 4096 and cfg.block.sliding.layers == set(range(cfg.n_layers))
    assert ModelConfig.from_dict(base | {"sliding_window": None}).block.sliding is None  # Mistral v0.2 and later
