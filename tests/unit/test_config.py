import json

import numpy as np
import pytest

from shards.formats.config import ConfigError, ModelConfig

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
}


def cfg(**over):
    return ModelConfig.from_dict({**BASE, **over}, source="test/config.json")


def test_defaults_follow_transformers():
    c = cfg()
    assert (c.n_kv_heads, c.head_dim, c.rope.theta, c.rope.kind) == (8, 8, 10000.0, "default")
    assert not c.tie_word_embeddings and not c.attention_bias and not c.qk_norm


def test_gqa_and_explicit_head_dim():
    c = cfg(num_key_value_heads=2, head_dim=32)
    assert (c.n_heads, c.n_kv_heads, c.head_dim) == (8, 2, 32)


def test_rope_theta_top_level_or_transformers5_rope_parameters():
    assert cfg(rope_theta=500000.0).rope.theta == 500000.0
    c = cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert (c.rope.theta, c.rope.kind) == (1e6, "default")


def test_llama3_rope_scaling_in_either_place():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    old = cfg(rope_theta=500000.0, rope_scaling=scaling)
    new = cfg(rope_parameters={**scaling, "rope_theta": 500000.0})
    assert old.rope == new.rope and old.rope.kind == "llama3"
    inv = old.rope.inv_freq(64)
    plain = cfg(rope_theta=500000.0).rope.inv_freq(64)
    # High frequencies are untouched, the lowest are divided by the factor, the middle band is smoothed.
    assert inv[0] == plain[0] and np.isclose(inv[-1], plain[-1] / 8)
    assert np.all(inv <= plain) and np.all(inv >= plain / 8)


def test_qwen2_has_biases_and_qwen3_has_qk_norm():
    assert cfg(architectures=["Qwen2ForCausalLM"]).attention_bias
    assert cfg(architectures=["Qwen3ForCausalLM"]).qk_norm
    assert cfg(architectures=["MistralForCausalLM"]).model_type == "mistral"


def test_eos_may_be_an_int_or_a_list():
    assert cfg(eos_token_id=2).eos_token_ids == (2,)
    assert cfg(eos_token_id=[2, 7]).eos_token_ids == (2, 7)


@pytest.mark.parametrize(
    "over,message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architectures"),
        ({"architectures": None}, "unsupported architectures"),
        ({"hidden_size": None}, "missing required field 'hidden_size'"),
        ({"hidden_size": "64"}, "hidden_size must be a positive integer"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"rms_norm_eps": -1}, "rms_norm_eps must be a positive number"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "unsupported rope type 'longrope'"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "missing required field 'factor'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": False}}, "truncate=false"),
        ({"rope_scaling": {"rope_type": "llama3"}}, "missing required field 'factor'"),
        ({"rope_theta": "big"}, "rope_theta must be a positive number"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
        ({"eos_token_id": "</s>"}, "eos_token_id"),
        ({"head_dim": 7}, "must be even"),
    ],
)
def test_bad_configs_name_the_file_and_field(over, message):
    with pytest.raises(ConfigError, match=message) as e:
        cfg(**over)
    assert "test/config.json" in str(e.value)


def test_unreadable_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read JSON"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_dir(tmp_path)


def test_fixture_configs(model_dir):
    c = ModelConfig.from_dir(model_dir)
    assert c.n_layers == 6 and c.vocab_size == 512
