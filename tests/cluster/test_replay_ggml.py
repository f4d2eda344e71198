"""Replay and batching are exact on the ggml engine, as a node runs the packaged SmolLM2 by default (requantized to
F16 on load; the file's own Q4_1 blocks are replayed exactly in tests/cluster/test_speculation_cluster.py, and are
batch-invariant in tests/engines/test_ggml_invariance.py): the last node killed after 60 tokens, the entry
replays prompt + 60 generated tokens as one prefill (past the 64 rows where ggml's own attention kernel changes),
and a seeded, penalized stream's text is the undisturbed run's, character for character; seeded requests beside 7
others give the texts they give alone, penalized or not. (ggml's matmul sums a lone row of a float weight in another order than a batch's rows:
the engine pads those steps, shards/engines/ggml/gemm_rows.py.) Real exo-node processes."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.cluster.test_replay import report
from tests.support.cluster import Cluster
from tests.support.http import stream_completion

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.formats.packaged import DEFAULT_MODEL, resolve_model  # noqa: E402

KILL_AFTER = 60


def test_the_last_node_killed_after_60_tokens_is_replayed_on_the_default_engine_and_a_seeded_text_is_unchanged(capsys):
    path, model_id = resolve_model(DEFAULT_MODEL)
    body = {
        "model": model_id,
        "prompt": "The old lighthouse keeper climbed the stairs and",
        "max_tokens": 72,  # the replayed stream goes on for 12 tokens past the kill
        "temperature": 0.8,
        "seed": 11,
        # penalties over the last 64 tokens: the replay's last node rebuilds that window from its own prompt
        "frequency_penalty": 0.4,
        "presence_penalty": 0.2,
        "repeat_penalty": 1.1,
        "logit_bias": {"30": -5},
    }
    with Cluster(path, 3, memory_gb=[2, 2, 2], model_id=model_id, engine=None, extra=["--threads", "1"]) as c:
        url = f"{c.nodes[0].api_url}/v1/completions"
        reference = "".join(e.text for e in stream_completion(url, body, timeout=120))
        events, killed = [], None
        for event in stream_completion(url, body, timeout=120):
            events.append(event)
            if len(events) == KILL_AFTER:
                c.nodes[2].proc.kill()
                killed = time.monotonic()
        assert killed is not None and len(events) > KILL_AFTER, "the stream ended before the kill"
        text = "".join(e.text for e in events)
        assert [e.error for e in events if e.error] == [] and text == reference
        assert c.self_info()["node0"]["status"]["replays"] == 1
        report(
            capsys,
            f"ggml SmolLM2 default engine (F16), kill -9 of the last node after {KILL_AFTER} tokens: replayed, seeded text "
            f"identical ({len(reference)} characters)",
        )


def test_eight_seeded_requests_at_once_give_the_texts_each_gives_alone_on_the_default_engine(capsys):
    path, model_id = resolve_model(DEFAULT_MODEL)
    bodies = [
        {
            "model": model_id,
            "prompt": f"Story {i}: the {word} walked into the village and",
            "max_tokens": 10,  # 8 rows decoded together for most of 10 steps: each step's rows go through the batch path
            "temperature": 0.9,
            "seed": 100 + i,
        }
        | ({"frequency_penalty": 0.5, "repeat_penalty": 1.2, "min_p": 0.05} if i % 2 else {})  # beside plain rows
        for i, word in enumerate(["miller", "knight", "fox", "stranger", "child", "merchant", "monk", "soldier"])
    ]
    with Cluster(path, 1, model_id=model_id, engine=None, extra=["--threads", "1"]) as c:
        url = f"{c.nodes[0].api_url}/v1/completions"

        def text(body):
            return "".join(e.text for e in stream_completion(url, body, timeout=120))

        alone = [text(body) for body in bodies]
        with ThreadPoolExecutor(len(bodies)) as pool:
            together = list(pool.map(text, bodies))
        assert together == alone
        report(capsys, "ggml SmolLM2 default: 8 seeded requests at once, texts identical to each alone")
