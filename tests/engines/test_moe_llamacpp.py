"""The ggml engine computes the mixture-of-experts GGUFs as llama.cpp does: llama.cpp's own logits on the same files
(tests/fixtures/moe/llamacpp.npz: llama-cpp-python 0.3.36, `bench/llamacpp_ref.py logits FILE --all --chunk 32
--tokens` over each fixture's prompt and greedy ids) against the engine's over the same positions. On the CPU they
were made on the two are bit-identical (docs/correctness.md, "Agreement with llama.cpp"); another CPU's kernels may
sum the same math in another order, so the bound is the engine's for regrouped positions, and the top token must
agree wherever llama.cpp's two best are further apart than twice that. Only with llama.cpp's attention kernel
(shards/engines/ggml/attention.py's ATTENTION "flash"): the F16-matmul attention rounds otherwise, which a routed
model amplifies past any such bound (the Q8_0 file: logits 1.6 apart, a router at a near-tie picking other experts)."""

import json
from functools import cache

import numpy as np
import pytest

from shards.engines.registry import engine_class, installed
from shards.formats.loader import load_config
from shards.model.shard import Shard
from shards.reference.generate import chain_forward
from tests.support.models import FIXTURES
from tests.support.tolerance import clear_top1_disagreements, regrouped_atol

pytestmark = pytest.mark.skipif("ggml" not in installed(), reason="the ggml engine is not installed")
attention = pytest.importorskip("shards.engines.ggml.attention", reason="the ggml extra is not installed")

MOE = FIXTURES / "moe"
# The Q8_0 file on a CPU other than the one its reference was made on: ggml picks its Q8_0 matmul kernel by the CPU's
# features and by how many rows an expert gets (a vector dot, or llamafile's tiles), and the kernels sum the blocks
# in their own order: some positions come out bit-identical, others up to 0.035 apart (an AVX-512 EPYC), with every
# top token the same.
QUANT_KERNEL_ATOL = 0.05


@cache
def path_ids(model: str) -> np.ndarray:
    g = json.loads((MOE / "golden.json").read_text())[model]
    return np.array(g["prompt_ids"] + g["greedy_ids"])


@pytest.mark.parametrize("file", ["qwen3moe.gguf", "qwen3moe.q8_0.gguf", "mixtral.gguf"])
def test_with_llama_cpps_attention_ggml_computes_moe_ggufs_as_llama_cpp_does(file, monkeypatch):
    monkeypatch.setattr(attention, "ATTENTION", "flash")
    with np.load(MOE / "llamacpp.npz") as z:
        reference = z[file.removesuffix(".gguf").replace(".", "_")]
    cfg = load_config(MOE / file)
    engine = engine_class("ggml")(MOE / file, Shard("m", 0, cfg.n_layers, cfg.n_layers), cfg)
    got = chain_forward([engine], "r", path_ids(file.split(".")[0]), all_logits=True)
    bound = QUANT_KERNEL_ATOL if ".q8_0." in file else regrouped_atol("ggml")
    assert np.abs(got - reference).max() <= bound
    wrong, clear = clear_top1_disagreements(got, reference, 2 * bound)
    assert not wrong and clear >= len(reference) // 2
