"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral) and Phi-3 served by three real nodes on loopback answer
exactly as one process holding the whole model: each node holds whole layers, every expert of them, so nothing is
lost by the split."""

import pytest

from shards.engines.registry import engine_class, installed
from shards.formats.loader import load_config
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard
from shards.reference.generate import generate
from tests.support.cluster import Cluster
from tests.support.models import FIXTURES

MOE = FIXTURES / "moe"
PROMPT = "Name a café in Paris."


def reference(model, engine: str, max_tokens: int) -> str:
    cfg, tok = load_config(model), Tokenizer.load(model)
    chain = [engine_class(engine)(model, Shard.whole("ref", cfg.n_layers), cfg)]
    ids = [
        r.token
        for r in generate(
            chain, tok.encode_chat([{"role": "user", "content": PROMPT}]), max_tokens, eos_ids=tok.eos_token_ids
        )
    ]
    return tok.decode(ids)


def answer(cluster: Cluster, max_tokens: int) -> str:
    status, body = cluster.chat(PROMPT, max_tokens=max_tokens, temperature=0)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == max_tokens  # (random weights: babble, but all of it compared)
    return body["choices"][0]["message"]["content"]


@pytest.mark.skipif("ggml" not in installed(), reason="the ggml extra is not installed")
def test_three_pinned_ggml_nodes_on_a_qwen3_moe_gguf_equal_one_process():
    model = MOE / "qwen3moe.q8_0.gguf"
    with Cluster(model, 3, shards=["0:1", "1:2", "2:3"], engine="ggml", model_id="qwen3moe.q8_0") as c:
        assert answer(c, 12) == reference(model, "ggml", 12)
        assert set(c.wait_idle().values()) == {0}


def test_three_automatic_numpy_nodes_on_a_qwen2_moe_folder_equal_one_process():
    model = MOE / "qwen2moe"
    with Cluster(model, 3, memory_gb=[2, 2, 2]) as c:
        assert answer(c, 12) == reference(model, "numpy", 12)
        assert sorted(len(info["loaded"]) for info in c.self_info().values()) == [1, 1, 1]


@pytest.mark.skipif("ggml" not in installed(), reason="the ggml extra is not installed")
def test_three_automatic_ggml_nodes_on_a_mixtral_gguf_equal_one_process():
    model = MOE / "mixtral.gguf"  # a `llama` GGUF with experts: Q/K rows in llama.cpp's order, rotated its way
    with Cluster(model, 3, memory_gb=[2, 2, 2], engine="ggml", model_id="mixtral") as c:
        assert answer(c, 12) == reference(model, "ggml", 12)


def test_three_pinned_numpy_nodes_on_a_phi3_folder_equal_one_process():
    model = MOE / "phi3"
    with Cluster(model, 3, shards=["0:1", "1:2", "2:3"]) as c:
        assert answer(c, 12) == reference(model, "numpy", 12)
