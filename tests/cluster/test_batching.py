"""Continuous batching on live nodes: prompts prefilled in chunks give the same text, KV cache memory is a budget
that requests wait for (or are refused by, with a 503), never an out-of-memory death."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tests.support.cluster import Cluster, reference
from tests.support.http import call_json as http
from tests.support.http import chat_admission
from tests.support.models import FIXTURES

MODEL = FIXTURES / "llama"
LONG = "Tell me everything about the sea, the ships that sail on it, the fish that swim in it and the storms. " * 2
POSITION_BYTES = 6 * 2 * 2 * 16 * 4  # the llama fixture: 6 layers x (key, value) x 2 kv heads x 16 dims x float32


def test_prompts_prefilled_in_small_chunks_through_three_nodes_give_the_single_process_text():
    # without speculation: rejected proposals are positions computed twice (tests/engines/test_speculative_decoding.py)
    extra = ["--prefill-chunk", "7", "--step-tokens", "16", "--speculate", "off"]
    with Cluster(MODEL, 3, shards=["0:2", "2:4", "4:6"], extra=extra) as c:
        status, body = c.chat(LONG, max_tokens=24, temperature=0)
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == reference(LONG, 24)[0]
        assert body["usage"]["prompt_tokens"] > 7 * 5  # cut into many chunks
        status = c.self_info()["node1"]["status"]
        assert status["step_positions"] == body["usage"]["prompt_tokens"] + 23  # every position exactly once
        assert set(c.wait_idle().values()) == {0}


def test_a_request_waits_for_kv_cache_room_then_runs():
    budget_gb = 250_000 / 2**30  # one request of ~120 positions (184 KB) fits, two don't
    with Cluster(MODEL, 1, extra=["--kv-memory-gb", f"{budget_gb:.9f}"]) as c:
        results = {}

        def ask(i):
            results[i] = c.chat(f"Question {i}?", max_tokens=100, temperature=0)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert [results[i][0] for i in range(2)] == [200, 200], results
        assert [results[i][1]["choices"][0]["message"]["content"] for i in range(2)] == [
            reference(f"Question {i}?", 100)[0] for i in range(2)
        ]
        status = c.self_info()["node0"]["status"]
        assert status["busy_retries"] >= 1  # the second one waited for the first to free its reservation
        assert set(c.wait_idle().values()) == {0}


def test_a_request_that_can_never_fit_the_kv_budget_is_refused_at_once():
    with Cluster(MODEL, 1, extra=["--kv-memory-gb", f"{250_000 / 2**30:.9f}"]) as c:
        started = time.monotonic()
        status, body = c.chat("Hi", max_tokens=200, temperature=0)  # ~220 positions: 338 KB > 250 KB
        assert status == 400 and "more than its budget" in body["error"]["message"]  # as sent, it never fits
        assert time.monotonic() - started < 5


def flood(c, n, max_tokens):
    """n requests at once; their outcomes."""
    body = {
        "model": "llama",
        "messages": [{"role": "user", "content": "Tell me a long story"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: chat_admission(c.nodes[0].api_url, body), range(n)))


def test_when_no_room_comes_within_the_queue_timeout_the_answer_is_503_with_retry_after():
    # room for one request at a time, and waiting for room only 0.1 s: of five at once, some must give up
    extra = ["--kv-memory-gb", f"{250_000 / 2**30:.9f}", "--queue-timeout", "0.1"]
    with Cluster(MODEL, 1, extra=extra) as c:
        outcomes = flood(c, 5, 130)
        assert set(outcomes) == {(200, None, None), (503, "2", "server_overloaded")}, outcomes
        assert set(c.wait_idle().values()) == {0}


def test_requests_beyond_the_entrys_concurrency_get_503_with_retry_after():
    with Cluster(MODEL, 1, extra=["--max-concurrent-requests", "1"]) as c:
        outcomes = flood(c, 8, 100)
        assert set(outcomes) == {(200, None, None), (503, "1", "server_overloaded")}, outcomes
        assert http("GET", f"{c.nodes[0].api_url}/healthcheck")[0] == 200
