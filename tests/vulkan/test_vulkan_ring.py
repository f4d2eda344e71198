"""A ring of a Vulkan node and a CPU node answers a chat request with the CPU engine's text: the first node's layers
on the Vulkan device (--device vulkan), the last node's on the CPU (--device cpu), activations between them over
gRPC as in any ring. Real exo-node processes on the packaged SmolLM2 (F16 weights, the node's default for it:
both backends' F16 kernels agree closely enough that greedy decoding keeps the CPU's tokens)."""

from __future__ import annotations

import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.ggml.engine import GgmlEngine  # noqa: E402
from shards.formats.loader import load_config  # noqa: E402
from shards.formats.packaged import DEFAULT_MODEL, default_quantize, resolve_model  # noqa: E402
from shards.formats.tokenizer import Tokenizer  # noqa: E402
from shards.model.shard import Shard  # noqa: E402
from shards.reference.generate import generate  # noqa: E402
from tests.support.cluster import Cluster  # noqa: E402

QUESTION = "What is the capital of France?"
MAX_TOKENS = 24


def cpu_answer(path, model_id: str) -> str:
    cfg, tok = load_config(path), Tokenizer.load(path)
    quantize = default_quantize(model_id, "ggml", None)
    e = GgmlEngine(path, Shard.whole(model_id, cfg.n_layers), cfg, threads=2, quantize=quantize, adapt_threads=False)
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
    ids = [r.token for r in generate([e], prompt, MAX_TOKENS, eos_ids=tok.eos_token_ids)]
    e.close()
    return tok.decode(ids)


def test_a_vulkan_node_and_a_cpu_node_answer_with_the_cpu_engines_text(vulkan_env, capsys):
    path, model_id = resolve_model(DEFAULT_MODEL)
    want = cpu_answer(path, model_id)
    with Cluster(
        path,
        2,
        shards=["0:15", "15:30"],
        model_id=model_id,
        engine="ggml",
        per_node=[["--device", "vulkan"], ["--device", "cpu"]],
        extra=["--threads", "2"],
    ) as c:
        status, body = c.chat(QUESTION, max_tokens=MAX_TOKENS, temperature=0)
    assert status == 200, body
    with capsys.disabled():
        print(f"\nVulkan + CPU ring: {body['choices'][0]['message']['content']!r}\nCPU engine:        {want!r}")
    assert body["choices"][0]["message"]["content"] == want  # (a node whose --device is missing refuses to start)
