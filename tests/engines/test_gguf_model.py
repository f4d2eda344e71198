"""GGUF as a model source: config from metadata, weights of every supported type, quantized tensors, dispatch.

References: tests/fixtures/gguf/golden.json, written by make_gguf_reference.py from transformers' GGUF loading and
from dequantizers independent of gguf-py (transformers' torch code; ggml's C reference for Q5_0/Q5_1).
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from shards.formats.gguf_file import GGUFError, open_gguf
from shards.formats.gguf_model import load_shard_tensors
from shards.formats.loader import load_config, load_shard_weights, open_model
from shards.formats.quant import SUPPORTED_TYPES, QuantizedTensor, unpermute_order
from shards.model.shard import Shard
from tests.support.gguf_util import GGUF_DIR, GGUF_MODELS, fixture, gguf_golden, smollm2_path


@pytest.mark.parametrize("name", GGUF_MODELS)
def test_config_matches_what_transformers_reads(name):
    g = gguf_golden()["models"][name]["config"]
    c = load_config(fixture(name))
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == (
        g["vocab_size"],
        g["hidden_size"],
        g["intermediate_size"],
        g["num_hidden_layers"],
        g["num_attention_heads"],
        g["num_key_value_heads"],
        g["head_dim"],
    )
    assert c.rms_norm_eps == pytest.approx(g["rms_norm_eps"], rel=1e-6)
    assert (c.max_position_embeddings, c.tie_word_embeddings, c.rope.theta) == (
        g["max_position_embeddings"],
        g["tie_word_embeddings"],
        g["rope_theta"],
    )
    assert (c.model_type, c.attention_bias, c.qk_norm) == {
        "llama": ("llama", False, False),
        "qwen2": ("qwen2", True, False),
        "qwen3": ("qwen3", False, True),
    }[name]


def test_smollm2_config_is_the_published_one():
    c = load_config(smollm2_path())
    assert (
        c.architecture,
        c.n_layers,
        c.hidden_size,
        c.n_heads,
        c.n_kv_heads,
        c.intermediate_size,
        c.vocab_size,
        c.rope.theta,
        c.max_position_embeddings,
        c.tie_word_embeddings,
    ) == ("LlamaForCausalLM", 30, 576, 9, 3, 1536, 49152, 100000.0, 8192, True)
    assert c.eos_token_ids == (2,)  # <|im_end|>


def test_the_fixtures_cover_every_supported_type():
    used = {t for g in gguf_golden()["models"].values() for t in g["types"].values()}
    used |= {info.ggml_type.name for info in open_gguf(GGUF_DIR / "lowbit.gguf").tensors.values()}  # the low-bit types
    assert used == {t.name for t in SUPPORTED_TYPES}


def _stored_types():
    return sorted({(t, name) for name, g in gguf_golden()["models"].items() for t in g["dequant"]})


@pytest.mark.parametrize("type_name,model", _stored_types())
def test_dequantized_weights_match_an_independent_dequantizer(type_name, model):
    ref = gguf_golden()["models"][model]["dequant"][type_name]
    f = open_gguf(fixture(model))
    info = f.tensor(ref["tensor"])
    q = QuantizedTensor(info.name, info.ggml_type, info.hf_shape, f.raw(info))
    assert q.ggml_type.name == type_name and list(q.shape) == ref["shape"]
    w = q.dequantize()
    assert w.dtype == np.float32 and w.shape == tuple(ref["shape"])
    assert np.array_equal(w[:4], np.asarray(ref["rows"], np.float32))
    assert float(w.astype(np.float64).sum()) == pytest.approx(ref["sum"], rel=1e-9, abs=1e-9)
    assert float(np.abs(w).astype(np.float64).sum()) == pytest.approx(ref["abs_sum"], rel=1e-9)


def test_quantized_tensors_are_read_only_views_of_the_file():
    cfg = load_config(smollm2_path())
    t = load_shard_tensors(smollm2_path(), cfg, Shard("s", 10, 12, 30), dequantize=False)
    assert set(t) == {
        f"{i}.{k}"
        for i in (10, 11)
        for k in (
            "input_norm",
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "post_norm",
            "gate_proj",
            "up_proj",
            "down_proj",
        )
    }
    up = t["10.up_proj"]
    assert (up.ggml_type, up.shape, up.nbytes) == (Q.Q4_1, (1536, 576), 1536 * 576 // 32 * 20)
    assert not up.data.flags.writeable and isinstance(up.data.base, np.ndarray)  # no copy of the mapping
    assert np.shares_memory(up.data, open_gguf(smollm2_path()).data)
    with pytest.raises(ValueError):
        up.data[0, 0] = 1
    assert t["10.k_proj"].shape == (192, 576) and not t["10.k_proj"].data.flags.writeable  # un-permuted copy


def test_row_permutation_on_raw_blocks_is_exact():
    f = open_gguf(smollm2_path())
    info = f.tensor("blk.3.attn_q.weight")
    q = QuantizedTensor(info.name, info.ggml_type, info.hf_shape, f.raw(info))
    order = unpermute_order(576, 9)
    assert sorted(order) == list(range(576))
    assert np.array_equal(q.permute_rows(order).dequantize(), q.dequantize()[order])


@pytest.mark.parametrize("ggml_type, dtype", [(Q.F32, np.float32), (Q.F16, np.float16)])
def test_a_llama_bias_is_permuted_by_element(ggml_type, dtype):
    """A Q/K bias of a llama file (llama.cpp's converter permutes them too) is one row of values in the file."""
    values = np.arange(64, dtype=dtype)
    bias = QuantizedTensor("blk.0.attn_q.bias", ggml_type, (64,), values.view(np.uint8).reshape(1, -1))
    order = unpermute_order(64, 4)
    assert np.array_equal(bias.permute_rows(order).dequantize(), values.astype(np.float32)[order])


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)  # 4 heads of 16 rows
    permuted = w.reshape(4, 2, 8, 3).swapaxes(1, 2).reshape(64, 3)  # llama.cpp convert_hf_to_gguf's permute
    assert np.array_equal(permuted[unpermute_order(64, 4)], w)


def test_float_weights_dispatch_on_the_path_and_share_the_tied_embedding():
    cfg = load_config(fixture("qwen2"))
    w = load_shard_weights(fixture("qwen2"), cfg, Shard.whole("q", cfg.n_layers))
    assert w.lm_head is w.embed_tokens and w.embed_tokens.dtype == np.float32
    assert w.layers[0].q_bias.shape == (64,) and len(w.layers) == 3
    last = load_shard_weights(fixture("qwen2"), cfg, Shard("q", 2, 3, 3))
    assert last.embed_tokens is None and np.array_equal(last.lm_head, w.embed_tokens)


def test_a_folder_holding_one_gguf_is_that_gguf(tmp_path):
    assert open_model(fixture("llama")).gguf == fixture("llama")
    assert open_model(GGUF_DIR.parent / "llama").gguf is None  # a Hugging Face folder
    (tmp_path / "m.gguf").write_bytes(fixture("qwen3").read_bytes())
    assert open_model(tmp_path).gguf == tmp_path / "m.gguf"
    assert load_config(tmp_path).qk_norm
    (tmp_path / "n.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="several .gguf files"):
        open_model(tmp_path)
