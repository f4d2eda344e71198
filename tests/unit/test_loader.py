"""The loader decides a model's format once, from the path alone; everything else (config, weights, tokenizer,
fetch layout, model ids) asks it. These are the rules, and the errors for paths that are no model."""

import shutil

import pytest

from shards.formats.gguf_file import GGUFError
from shards.formats.loader import ModelFormatError, ModelSource, load_config, open_model
from shards.formats.packaged import model_id
from shards.formats.tokenizer import Tokenizer
from tests.conftest import FIXTURES
from tests.support.gguf_util import fixture


def test_a_hugging_face_folder_is_safetensors_and_its_own_root():
    src = open_model(FIXTURES / "qwen2")
    assert (src.format, src.root, src.gguf) == ("safetensors", FIXTURES / "qwen2", None)
    assert src.config.model_type == "qwen2" and src.default_id == "qwen2"


def test_a_gguf_file_lies_in_its_root_and_names_the_model_by_its_stem(tmp_path):
    path = tmp_path / "Tiny-Model.Q8_0.GGUF"  # the suffix is matched in any case
    shutil.copy(fixture("qwen3"), path)
    src = open_model(path)
    assert (src.format, src.root, src.gguf) == ("gguf", tmp_path, path)
    assert src.default_id == "tiny-model.q8_0" and model_id(path) == "tiny-model.q8_0"
    assert src.config.qk_norm and load_config(path) == src.config


def test_a_folder_holding_one_gguf_is_that_model_named_by_the_folder(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    shutil.copy(fixture("qwen3"), folder / "weights.gguf")
    src = open_model(folder)
    assert (src.format, src.root, src.gguf) == ("gguf", folder, folder / "weights.gguf")
    assert model_id(folder) == "my-model"  # a fetched copy's folder carries the model id; its file does not
    assert Tokenizer.load(folder).vocab_size == Tokenizer.load(fixture("qwen3")).vocab_size


def test_config_json_makes_a_hugging_face_folder_even_beside_a_gguf(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / "qwen2", d)
    shutil.copy(fixture("llama"), d / "other.gguf")
    assert open_model(d).format == "safetensors"


def test_paths_that_are_no_model_are_refused_with_what_to_pass(tmp_path):
    with pytest.raises(
        ModelFormatError,
        match=r"no config.json .* and no .gguf file; pass a .gguf file or a Hugging "
        r"Face model folder",
    ):
        open_model(tmp_path)
    (tmp_path / "model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ModelFormatError, match=r"model.bin: not a model: a model file must be GGUF \(named \*.gguf\)"):
        open_model(tmp_path / "model.bin")
    with pytest.raises(ModelFormatError, match="no such file or folder"):
        open_model(tmp_path / "absent")
    with pytest.raises(GGUFError, match="absent.gguf: no such file"):
        open_model(tmp_path / "absent.gguf")
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match=r"several .gguf files \(a.gguf, b.gguf\); pass one of them"):
        open_model(tmp_path)


def test_a_source_is_consistent_by_construction(tmp_path):
    with pytest.raises(ValueError, match="model format must be one of"):
        ModelSource("pytorch", tmp_path, tmp_path)
    with pytest.raises(ValueError, match="a GGUF model names its file"):
        ModelSource("gguf", tmp_path, tmp_path)
    with pytest.raises(ValueError, match="does not lie in the model's folder"):
        ModelSource("gguf", tmp_path / "x.gguf", tmp_path / "elsewhere", tmp_path / "x.gguf")
