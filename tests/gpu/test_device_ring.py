"""A ring of a GPU node and a CPU node answers a chat request with the CPU engine's text: the first node's layers on
the device (--device BACKEND), the last node's on the CPU (--device cpu), activations between them over gRPC as in
any ring. Real exo-node processes, on the packaged SmolLM2 (F16 weights, the node's default for it: both backends'
F16 kernels agree closely enough that greedy decoding keeps the CPU's tokens) and on the llama fixture (float32, no
download: what runs on a machine that can reach no package index)."""

from __future__ import annotations

import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.ggml.engine import GgmlEngine  # noqa: E402
from shards.formats.loader import load_config  # noqa: E402
from shards.formats.packaged import DEFAULT_MODEL, default_quantize, resolve_model  # noqa: E402
from shards.formats.tokenizer import Tokenizer  # noqa: E402
from shards.model.shard import Shard  # noqa: E402
from shards.reference.generate import generate  # noqa: E402
from tests.gpu.conftest import BACKEND  # noqa: E402
from tests.support.cluster import Cluster  # noqa: E402
from tests.support.models import FIXTURES  # noqa: E402

QUESTION = "What is the capital of France?"
MAX_TOKENS = 24


def cpu_answer(path, model_id: str, quantize: str | None) -> str:
    cfg, tok = load_config(path), Tokenizer.load(path)
    e = GgmlEngine(path, Shard.whole(model_id, cfg.n_layers), cfg, threads=2, quantize=quantize, adapt_threads=False)
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
    ids = [r.token for r in generate([e], prompt, MAX_TOKENS, eos_ids=tok.eos_token_ids)]
    e.close()
    return tok.decode(ids)


def ring_answer(path, model_id: str, shards: list[str], extra: list[str]) -> str:
    with Cluster(
        path,
        2,
        shards=shards,
        model_id=model_id,
        engine="ggml",
        per_node=[["--device", BACKEND], ["--device", "cpu"]],
        extra=["--threads", "2", *extra],
    ) as c:
        status, body = c.chat(QUESTION, max_tokens=MAX_TOKENS, temperature=0)
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def test_a_gpu_node_and_a_cpu_node_answer_smollm2_with_the_cpu_engines_text(gpu_env, capsys):
    path, model_id = resolve_model(DEFAULT_MODEL)
    want = cpu_answer(path, model_id, default_quantize(model_id, "ggml", None))
    got = ring_answer(path, model_id, ["0:15", "15:30"], [])
    with capsys.disabled():
        print(f"\n{gpu_env.name} + CPU ring: {got!r}\nCPU engine:        {want!r}")
    assert got == want  # (a node whose --device is missing refuses to start)


def test_a_gpu_node_and_a_cpu_node_answer_the_fixture_with_the_cpu_engines_text(gpu_env, capsys):
    path = FIXTURES / "llama"
    want = cpu_answer(path, "llama", "none")
    got = ring_answer(path, "llama", ["0:3", "3:6"], ["--quantize", "none"])
    with capsys.disabled():
        print(f"\n{gpu_env.name} + CPU ring, llama fixture: {got!r}\nCPU engine: {want!r}")
    assert got == want and len(want) > 0
