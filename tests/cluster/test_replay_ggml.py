"""Replay is exact on the ggml engine computing on a file's quantized blocks (SmolLM2's Q4_1, `--quantize none`):
the last node killed after 70 tokens, the entry replays prompt + 70 generated tokens as one prefill (past the 64
rows where ggml's own attention kernel changes), and a seeded stream's text is the undisturbed run's, character
for character. (With F16 or F32 weights, the packaged SmolLM2's default F16 included, ggml's matrix products depend
on a step's row count, and it is not: docs/operations.md#failures-and-replay.) Real exo-node processes."""

import time

import pytest

from tests.cluster.test_replay import report
from tests.support.cluster import Cluster
from tests.support.http import stream_completion

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.formats.packaged import DEFAULT_MODEL, resolve_model  # noqa: E402

KILL_AFTER = 70


def test_the_last_node_killed_after_70_tokens_is_replayed_on_ggml_and_a_seeded_text_is_unchanged(capsys):
    path, model_id = resolve_model(DEFAULT_MODEL)
    body = {
        "model": model_id,
        "prompt": "The old lighthouse keeper climbed the stairs and",
        "max_tokens": 110,
        "temperature": 0.8,
        "seed": 11,
    }
    with Cluster(
        path, 3, memory_gb=[2, 2, 2], model_id=model_id, engine=None, extra=["--threads", "1", "--quantize", "none"]
    ) as c:
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
            f"ggml SmolLM2 Q4_1, kill -9 of the last node after {KILL_AFTER} tokens: replayed, seeded text "
            f"identical ({len(reference)} characters)",
        )
