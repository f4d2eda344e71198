"""Loading a shard reads only its own tensors, exactly (bf16/f16 widen losslessly), with clear errors."""

import json
import shutil

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from shards.engines.numpy_engine import NumpyEngine
from shards.formats.config import ModelConfig
from shards.formats.loader import load_shard_weights
from shards.formats.weights import WeightsError
from shards.model.shard import Shard
from tests.conftest import FIXTURES


def load(model, start, end, model_dir=None):
    d = model_dir or FIXTURES / model
    cfg = ModelConfig.from_dir(d)
    return load_shard_weights(d, cfg, Shard(model, start, end, cfg.n_layers))


def test_first_middle_last_shards_hold_only_their_parts(model):
    first, middle, last = load(model, 0, 2), load(model, 2, 4), load(model, 4, 6)
    assert first.embed_tokens is not None and first.lm_head is None and first.norm is None
    assert middle.embed_tokens is None and middle.lm_head is None and middle.norm is None
    assert last.embed_tokens is None and last.lm_head is not None and last.norm is not None
    assert [len(s.layers) for s in (first, middle, last)] == [2, 2, 2]


def test_tied_models_use_the_embedding_as_head():
    qwen2 = load("qwen2", 0, 6)  # tie_word_embeddings: the checkpoint has no lm_head.weight
    assert np.array_equal(qwen2.lm_head, qwen2.embed_tokens)
    llama = load("llama", 0, 6)
    assert not np.array_equal(llama.lm_head, llama.embed_tokens)


def test_half_the_layers_hold_about_half_the_layer_weights(model):
    d = FIXTURES / model
    cfg = ModelConfig.from_dir(d)
    whole = NumpyEngine(d, Shard(model, 1, 5, 6), cfg)  # middle shards: layer weights only
    half = NumpyEngine(d, Shard(model, 1, 3, 6), cfg)
    assert half.nbytes() * 2 == whole.nbytes()
    full = NumpyEngine(d, Shard.whole(model, 6), cfg)
    m = full.model
    layers_only = full.nbytes() - m.embed_tokens.nbytes - m.lm_head.weight.nbytes - m.norm.weight.nbytes
    assert layers_only == 3 * half.nbytes()  # 6 layers vs 2


@pytest.mark.parametrize("model,dtype", [("llama", "BF16"), ("qwen3", "F16"), ("qwen2", "F32")])
def test_disk_dtypes_widen_exactly_to_float32(model, dtype):
    d = FIXTURES / model
    index = d / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    name = "model.layers.0.mlp.down_proj.weight"
    for fname in files:
        with safe_open(d / fname, framework="numpy") as f:
            if name in f.keys():
                assert f.get_slice(name).get_dtype() == dtype
                raw = f.get_tensor(name)
    w = load(model, 0, 1)
    assert w.layers[0].down_proj.dtype == np.float32
    assert np.array_equal(w.layers[0].down_proj, raw.astype(np.float32))


def test_sharded_checkpoint_opens_only_the_files_it_needs(tmp_path):
    d = tmp_path / "llama"
    shutil.copytree(FIXTURES / "llama", d)
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {f for n, f in weight_map.items() if n.startswith("model.layers.0.")}
    for f in set(weight_map.values()) - needed:
        (d / f).write_bytes(b"garbage that is not a safetensors file")
    assert len(load("llama", 0, 1, d).layers) == 1  # untouched files are never read


def _rewrite(d, name, array):
    path = d / "model.safetensors"
    with safe_open(path, framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if array is None:
        del tensors[name]
    else:
        tensors[name] = array
    save_file(tensors, path)
    return path


@pytest.fixture
def qwen2_copy(tmp_path):
    d = tmp_path / "qwen2"
    shutil.copytree(FIXTURES / "qwen2", d)
    return d


def test_missing_tensor_names_tensor(qwen2_copy):
    _rewrite(qwen2_copy, "model.layers.3.mlp.up_proj.weight", None)
    assert len(load("qwen2", 0, 3, qwen2_copy).layers) == 3  # the first half doesn't need it
    with pytest.raises(WeightsError, match=r"model\.layers\.3\.mlp\.up_proj\.weight.*not found"):
        load("qwen2", 3, 6, qwen2_copy)


def test_wrong_shape_names_file_and_tensor(qwen2_copy):
    path = _rewrite(qwen2_copy, "model.norm.weight", np.ones(65, dtype=np.float32))
    with pytest.raises(
        WeightsError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has shape \[65\], expected \[64\]"
    ) as e:
        load("qwen2", 3, 6, qwen2_copy)
    assert str(path) in str(e.value)


def test_unsupported_dtype_is_rejected(qwen2_copy):
    _rewrite(qwen2_copy, "model.norm.weight", np.ones(64, dtype=np.int32))
    with pytest.raises(WeightsError, match="dtype I32"):
        load("qwen2", 5, 6, qwen2_copy)


def test_corrupt_or_missing_checkpoint(tmp_path, qwen2_copy):
    (qwen2_copy / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    with pytest.raises(WeightsError, match="model.safetensors"):
        load("qwen2", 0, 1, qwen2_copy)
    (qwen2_copy / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no model.safetensors"):
        load("qwen2", 0, 1, qwen2_copy)


def test_index_may_not_point_outside_the_folder(tmp_path):
    d = tmp_path / "llama"
    shutil.copytree(FIXTURES / "llama", d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../../etc/passwd"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="outside the model folder"):
        load("llama", 0, 6, d)
