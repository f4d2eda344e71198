"""Split GGUF files (llama.cpp's gguf-split: `NAME-00001-of-00003.gguf`, ...): named by the first part or by their
folder, read as one model whose shards take each tensor from the part holding it, and equal to the unsplit file.
The parts are written here by gguf-py's writer the way gguf-split writes them (tests/support/gguf_util.split_gguf)."""

import shutil

import numpy as np
import pytest

from shards.engines.registry import engine_class, installed
from shards.formats.gguf_file import GGUFError, open_gguf
from shards.formats.gguf_model import load_shard_tensors
from shards.formats.loader import load_config, open_model
from shards.model.shard import Shard
from shards.reference.generate import chain_forward
from tests.support.gguf_util import GGUF_DIR, split_gguf
from tests.support.models import golden

WHOLE = GGUF_DIR / "llama31.gguf"  # 58 tensors: 20 + 20 + 18 in three parts
THREE = [(0, 2), (2, 4), (4, 6)]


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    return split_gguf(WHOLE, tmp_path_factory.mktemp("split"), max_tensors=20)


def test_the_first_part_or_the_folder_names_the_model(split):
    assert split.name == "llama31-00001-of-00003.gguf"
    assert open_model(split.parent).gguf == split and open_model(split).default_id == "llama31"
    assert load_config(split) == load_config(WHOLE)
    f = open_gguf(split)
    assert [len(p.tensors) for p in f.parts()] == [20, 20, 18]
    assert set(f.tensors) == set(open_gguf(WHOLE).tensors)


def test_another_part_or_a_missing_part_is_refused_by_name(split, tmp_path):
    with pytest.raises(GGUFError, match="part 2 of a split model; name its first part, llama31-00001-of-00003.gguf"):
        open_gguf(split.with_name("llama31-00002-of-00003.gguf"))
    partial = tmp_path / "partial"
    partial.mkdir()
    for p in split.parent.glob("*-0000[12]-of-*.gguf"):
        shutil.copy(p, partial / p.name)
    with pytest.raises(GGUFError, match="part llama31-00003-of-00003.gguf of this split model is missing"):
        open_gguf(partial / split.name)


def test_a_shard_reads_only_the_parts_holding_its_tensors(split):
    cfg, f = load_config(split), open_gguf(split)
    parts = f.parts()
    last = Shard("m", 4, 6, cfg.n_layers)
    tensors = load_shard_tensors(split, cfg, last, dequantize=False, unpermute=False)  # views of the mappings
    holders = {f.tensors[q.name].part for q in tensors.values()}
    assert 0 not in holders  # layers 4-5, the norm and the head lie in parts 2 and 3 only
    for q in tensors.values():
        assert np.shares_memory(q.data, parts[f.tensors[q.name].part].data)


@pytest.mark.parametrize("engine_name", [e for e in ("numpy", "ggml") if e in installed()])
def test_three_shards_of_a_split_file_equal_the_unsplit_file(split, engine_name):
    cfg = load_config(split)
    options = {"threads": 1} if engine_name == "ggml" else {}
    tokens = np.array(golden("llama")["prompt_ids"])

    def chain(path, ranges):
        return [engine_class(engine_name)(path, Shard("m", a, b, cfg.n_layers), cfg, **options) for a, b in ranges]

    whole = chain_forward(chain(WHOLE, [(0, 6)]), "r", tokens, all_logits=True)
    assert np.array_equal(chain_forward(chain(split, THREE), "r", tokens, all_logits=True), whole)
