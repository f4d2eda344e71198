"""/metrics: Prometheus text that prometheus_client's own parser reads, with numbers that add up after real traffic."""

from __future__ import annotations

import asyncio
import json

import numpy as np
from prometheus_client import generate_latest

from node.core.step_plan import Row, StepPlan
from shards.model.shard import Shard
from tests.support.http import post, raw
from tests.support.metrics import parse, scrape, value
from tests.support.polling import wait_until
from tests.unit.test_node_rpc import serving, shutdown, spec_for


def test_counters_and_histograms_add_up_after_real_traffic(live_cluster):
    """3 nodes pinned 0:2 / 2:4 / 4:6, entry node0; each node's own /metrics."""
    urls = {n.node_id: n.api_url for n in live_cluster.nodes}
    entry = urls["node0"]
    before = {node: scrape(url) for node, url in urls.items()}

    status, _, body = post(
        entry,
        "/v1/chat/completions",
        {"model": "llama", "max_tokens": 7, "temperature": 0, "messages": [{"role": "user", "content": "count"}]},
    )
    assert status == 200
    usages = [json.loads(body)["usage"]]
    status, _, body = post(
        entry,
        "/v1/completions",
        {
            "model": "llama",
            "prompt": "Once upon",
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200
    usages.append(
        next(
            json.loads(line[6:])["usage"]
            for line in body.decode().split("\n\n")
            if line.startswith("data: {") and '"usage"' in line
        )
    )
    status, _, _ = post(
        entry,
        "/v1/chat/completions",
        {
            "model": "llama",
            "max_tokens": 300,  # beyond the context
            "messages": [{"role": "user", "content": "x"}],
        },
    )
    assert status == 400
    wait_idle(urls)
    after = {node: scrape(url) for node, url in urls.items()}

    def delta(node: str, name: str, **labels: str) -> float:
        return value(after[node], name, **labels) - value(before[node], name, **labels)

    generated = sum(u["completion_tokens"] for u in usages)
    assert delta("node0", "exo_requests_total", endpoint="chat", outcome="length") == 1
    assert delta("node0", "exo_requests_total", endpoint="completions", outcome="length") == 1
    assert delta("node0", "exo_requests_total", endpoint="chat", outcome="rejected") == 1
    assert delta("node0", "exo_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("node0", "exo_completion_tokens_total") == generated == 12
    assert delta("node0", "exo_time_to_first_token_seconds_count") == 2
    assert delta("node0", "exo_time_to_first_token_seconds_sum") > 0
    assert delta("node0", "exo_inter_token_latency_seconds_count") == generated - 2  # gaps between tokens
    assert delta("node0", "exo_inter_token_latency_seconds_bucket", le="+Inf") == generated - 2
    for node in urls:
        # one pass per token on every node (the prompt's pass gives the first); sequential requests: one row each
        assert delta(node, "exo_forward_step_seconds_count") == generated, node
        assert delta(node, "exo_forward_step_rows_sum") == generated, node
        assert delta(node, "exo_forward_step_rows_bucket", le="1.0") == generated, node
        assert value(after[node], "exo_peers") == 2
        assert value(after[node], "exo_requests_in_flight") == 0
        assert value(after[node], "exo_kv_cache_bytes") == 0  # every cache was released
        assert value(after[node], "exo_weights_bytes") > 0
    assert delta("node2", "exo_sampling_rows_total") == generated  # the last node samples
    assert delta("node2", "exo_sampling_batch_size_count") == generated
    assert delta("node2", "exo_sampling_batch_size_sum") == generated
    assert delta("node0", "exo_sampling_rows_total") == 0
    assert delta("node2", "exo_sampling_picked_total") == 7  # the greedy chat's rows; the completion samples
    assert value(after["node2"], "exo_sampling_fallbacks_total") == 0
    # (the entry ends a finished request on the other nodes with reason "cancelled" today: count every reason)
    assert sum(delta("node1", "exo_node_requests_ended_total", reason=r) for r in ("finished", "cancelled")) == 2


def wait_idle(urls: dict[str, str], timeout: float = 10) -> None:
    wait_until(
        lambda: not any(value(scrape(url), "exo_requests_in_flight") for url in urls.values()),
        timeout,
        "no request in flight on any node",
    )


def test_metrics_needs_the_api_key_like_the_rest_of_the_api(single_api):
    url, key = single_api
    status, _, _ = raw(url, "GET", "/metrics", timeout=10)
    assert status == 401, "/metrics answered without the key"
    assert value(scrape(url, key), "exo_peers") == 0


def test_rpc_errors_per_peer_and_kv_cache_bytes_in_process():
    """Two nodes in one process keep separate registries; a send to a dead next hop is counted under its address;
    the KV-cache gauge follows a real engine's caches."""

    async def go():
        node, server, client = await serving(pinned=(0, 3), rpc_timeout=2.0)
        other, other_server, other_client = await serving(node_id="n1")
        try:
            node.accept_prompt(spec_for(node), np.array([1, 2, 3]))  # the plan's next node, 127.0.0.1:9, is dead
            for _ in range(200):  # the send waits up to its 2 s deadline for a connection that never comes
                if value(
                    parse(generate_latest(node.metrics.registry).decode()),
                    "exo_peer_rpc_errors_total",
                    peer="127.0.0.1:9",
                    call="send",
                ):
                    break
                await asyncio.sleep(0.025)
            samples = parse(generate_latest(node.metrics.registry).decode())
            assert value(samples, "exo_peer_rpc_errors_total", peer="127.0.0.1:9", call="send") == 1
            assert value(samples, "exo_node_requests_ended_total", reason="failed") == 1
            assert not any(
                name == "exo_peer_rpc_errors_total"
                for name, _ in parse(generate_latest(other.metrics.registry).decode())
            )

            engine = await other.shards.get(Shard("llama", 0, 6, 6))
            await other.shards.execute(engine, StepPlan(engine.shard, None, (Row("r", np.array([5, 6, 7, 8])),)))
            samples = parse(generate_latest(other.metrics.registry).decode())
            assert value(samples, "exo_kv_cache_bytes") == engine.cache_bytes() > 0
            assert other.info().status["kv_cache_bytes"] == engine.cache_bytes()
            other.shards.release("r")
            await other.shards.run(lambda: None)  # after the queued release
            assert value(parse(generate_latest(other.metrics.registry).decode()), "exo_kv_cache_bytes") == 0
        finally:
            await shutdown(other, other_server, other_client)
            await shutdown(node, server, client)

    asyncio.run(go())
