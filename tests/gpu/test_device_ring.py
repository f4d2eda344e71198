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


def test_a_ring_through_a_gpu_node_replays_a_stream_whose_last_node_is_killed(gpu_env, capsys):
    """Three nodes, the first on the device: the last is killed mid-stream, the entry replays prompt + the tokens so
    far on the two left (the GPU node prefills them in one step where it had decoded them one by one), and the
    stream goes on to its length without an error. Before the kill the text is the undisturbed run's exactly (the
    same steps on the same device); after it, the device's rounding may take another token at a near-tie
    (tests/gpu/test_device_state.py bounds the logits), so the text is compared only where that cannot apply."""
    from tests.cluster.test_replay import PROMPT
    from tests.support.http import stream_completion

    body = {"model": "llama", "prompt": PROMPT, "max_tokens": 100, "temperature": 0}
    with Cluster(
        FIXTURES / "llama",
        3,
        memory_gb=[2, 2, 2],
        model_id="llama",
        engine="ggml",
        per_node=[["--device", BACKEND], ["--device", "cpu"], ["--device", "cpu"]],
        extra=["--threads", "1", "--quantize", "none"],
    ) as c:
        url = f"{c.nodes[0].api_url}/v1/completions"
        reference = list(stream_completion(url, body, timeout=120))
        events = []
        for event in stream_completion(url, body, timeout=120):
            events.append(event)
            if len(events) == 12:
                before = "".join(e.text for e in events)
                c.nodes[2].proc.kill()
        text = "".join(e.text for e in events)
        assert [e.error for e in events if e.error] == [] and c.self_info()["node0"]["status"]["replays"] == 1
        assert "".join(e.text for e in reference).startswith(before) and text.startswith(before)
        assert events[-1].finish_reason == reference[-1].finish_reason == "length"
        with capsys.disabled():
            same = text == "".join(e.text for e in reference)
            print(f"\n{gpu_env.name} + 2 CPU nodes, last killed after 12 events: replayed, text identical: {same}")


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.8, "top_k": 40, "top_p": 0.9},  # Ollama's defaults
        {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1},  # llama-server's
        {"temperature": 0.0, "repeat_penalty": 1.3, "presence_penalty": 0.5, "logit_bias": {"7": -100}},
    ],
    ids=["top-k", "top-k penalized", "greedy penalized"],
)
def test_a_gpu_node_draws_a_seeded_top_k_request_from_its_best_logits_as_from_its_logits(gpu_env, sampling):
    """A seeded request with Ollama's sampling defaults on a GPU node, with a repetition penalty too, or greedy
    with penalties and a banned token: its rows come back from the device as their 128 best logits
    (exo_sampling_drawn_total), and its text is the text of the same request with logprobs asked, whose rows come
    back whole and go through the sampler as ever."""
    from tests.support.metrics import scrape, value

    params = {"max_tokens": 24, "seed": 11, **sampling}
    with Cluster(
        FIXTURES / "llama",
        1,
        model_id="llama",
        engine="ggml",
        per_node=[["--device", BACKEND]],
        extra=["--threads", "2", "--quantize", "none"],
    ) as c:
        status, drawn = c.chat(QUESTION, **params)
        assert status == 200, drawn
        metrics = scrape(c.nodes[0].api_url)
        status, whole = c.chat(QUESTION, logprobs=True, **params)
        assert status == 200, whole
        after = scrape(c.nodes[0].api_url)
    tokens = drawn["usage"]["completion_tokens"]
    assert value(metrics, "exo_sampling_drawn_total") >= tokens - 2  # the first token's row too (a tie: rare)
    assert value(after, "exo_sampling_drawn_total") == value(metrics, "exo_sampling_drawn_total")
    assert drawn["choices"][0]["message"]["content"] == whole["choices"][0]["message"]["content"]
    assert tokens > 1 and whole["choices"][0]["logprobs"] is not None
