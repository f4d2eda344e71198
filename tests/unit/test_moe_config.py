"""Mixture-of-experts configs from config.json and GGUF metadata, and refusals that name the missing feature."""

import json

import pytest
from gguf import GGUFValueType as V

from shards.formats.config import ConfigError, ModelConfig
from shards.formats.gguf_file import GGUFError
from shards.formats.loader import load_config
from tests.support.gguf_util import rewrite
from tests.support.models import FIXTURES

MOE = FIXTURES / "moe"


def raw(name: str) -> dict:
    return json.loads((MOE / name / "config.json").read_text())


def test_a_gguf_says_what_its_folder_says():
    for name in ("qwen3moe", "qwen2moe", "mixtral"):
        assert load_config(MOE / f"{name}.gguf").moe == ModelConfig.from_dir(MOE / name).moe


def test_qwen_sparse_step_and_mlp_only_layers_make_dense_layers():
    cfg = ModelConfig.from_dict(raw("qwen3moe") | {"decoder_sparse_step": 2, "mlp_only_layers": [2]})
    assert cfg.moe.dense_layers == {0, 2} and [cfg.moe.sparse(i) for i in range(3)] == [False, True, False]


def test_mixtral_always_renormalises_and_qwen2_moe_only_when_asked():
    assert ModelConfig.from_dir(MOE / "mixtral").moe.normalize
    assert not ModelConfig.from_dir(MOE / "qwen2moe").moe.normalize
    assert ModelConfig.from_dict(raw("qwen2moe") | {"norm_topk_prob": True}).moe.normalize


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts_per_tok": 9}, "9 experts per token but only 8 experts"),
        ({"num_experts_per_tok": None}, "n_used must be a positive integer"),
        ({"moe_intermediate_size": 0}, "expert_size must be a positive integer"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
        ({"mlp_only_layers": "all"}, "mlp_only_layers a list"),
    ],
)
def test_bad_moe_fields_are_refused_naming_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw("qwen2moe") | change)


def test_deepseek_is_refused_naming_multi_head_latent_attention(tmp_path):
    with pytest.raises(ConfigError, match="DeepseekV3ForCausalLM needs multi-head latent attention"):
        ModelConfig.from_dict(raw("qwen3moe") | {"architectures": ["DeepseekV3ForCausalLM"]})
    path = rewrite(
        MOE / "qwen3moe.gguf", tmp_path / "d.gguf", replace={"general.architecture": ("deepseek2", V.STRING)}
    )
    with pytest.raises(GGUFError, match="deepseek2 needs multi-head latent attention"):
        load_config(path)


def test_a_moe_architecture_without_experts_is_refused(tmp_path):
    path = rewrite(MOE / "qwen3moe.gguf", tmp_path / "e.gguf", drop=("qwen3moe.expert_count",))
    with pytest.raises(GGUFError, match="without qwen3moe.expert_count"):
        load_config(path)
