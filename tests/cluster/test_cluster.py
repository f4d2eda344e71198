"""Live clusters of real exo-node processes on loopback produce exactly the single-process tokens."""

import time
from concurrent.futures import ThreadPoolExecutor

from shards.engines.numpy_engine import NumpyEngine
from shards.formats.config import ModelConfig
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard
from shards.reference.generate import generate
from tests.support.cluster import Cluster, assert_matches_reference, free_port, reference
from tests.support.models import FIXTURES

MODEL = FIXTURES / "llama"
PROMPTS = ["The capital of France is", "Hello there, how are you?", "Write a poem about the sea.", "Why?"]


def loaded_shards(cluster: Cluster) -> dict[str, list[str]]:
    return {node_id: info["loaded"] for node_id, info in cluster.self_info().items()}


def statuses(cluster: Cluster) -> dict[str, dict[str, int]]:
    return {node_id: info["status"] for node_id, info in cluster.self_info().items()}


def grown(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """What each node's counters gained between two reads (the session's shared cluster served others before)."""
    return {
        node: {k: v - before[node].get(k, 0) for k, v in counters.items() if isinstance(v, int)}
        for node, counters in after.items()
    }


# Tests on the pinned 3-node cluster that leave it as they found it share the session's `live_cluster` (conftest:
# 0:2 / 2:4 / 4:6, an API on every node) and read its counters as differences.
def test_three_pinned_nodes_equal_one_process(live_cluster):
    c = live_cluster
    assert_matches_reference(c, PROMPTS[0])
    assert_matches_reference(c, PROMPTS[1], node=c.nodes[2])  # any node can be the entry
    assert loaded_shards(c) == {"node0": ["llama[0:2/6]"], "node1": ["llama[2:4/6]"], "node2": ["llama[4:6/6]"]}
    assert set(c.wait_idle().values()) == {0}


def test_every_node_of_a_ring_counts_the_stages_of_its_hops(live_cluster):
    """The counters bench_overhead and the links benchmark read (node/runtime/overhead.py) are live on every node:
    each sends, receives and runs passes, so each counts every stage (the CPU clocks once went dead unnoticed)."""
    c = live_cluster
    before = statuses(c)
    assert_matches_reference(c, PROMPTS[3])
    gained = grown(before, statuses(c))
    stages = ("loop_wakes", "hop_writes", "hop_sends", "hop_accepts", "hop_queued", "engine_wakes", "cpu_passes")
    assert {node: [s for s in stages if counts.get(s, 0) < 1] for node, counts in gained.items()} == {
        node: [] for node in gained
    }
    assert set(c.wait_idle().values()) == {0}


def test_greedy_rows_are_picked_where_their_logits_are_and_give_the_samplers_tokens(live_cluster):
    """A greedy request's tokens come back from the last node's engine as token ids (shards/engines/picks.py); asking
    for logprobs keeps its rows' logits, sampled as before: the same tokens either way."""
    c = live_cluster
    before = statuses(c)
    status, picked = c.chat(PROMPTS[2], max_tokens=16, temperature=0)
    assert status == 200, picked
    mid = statuses(c)
    status, sampled = c.chat(PROMPTS[2], max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    assert status == 200, sampled
    first, second = grown(before, mid)["node2"], grown(mid, statuses(c))["node2"]
    assert first.get("picked_rows", 0) == first["presampled_rows"] >= 16
    assert second.get("picked_rows", 0) == 0 and second["presampled_rows"] >= 16
    assert picked["choices"][0]["message"]["content"] == sampled["choices"][0]["message"]["content"]
    assert set(c.wait_idle().values()) == {0}


def test_a_ring_without_a_cluster_key_carries_its_data_path_on_the_links(live_cluster):
    """Once the peers' health checks named their data links (node/grpc/link/), every hop of a request goes on them:
    each node of the ring takes its input from the link (activations; tokens at the entry), with the tokens the
    one-process reference gives."""
    c = live_cluster
    deadline = time.monotonic() + 15  # the links come up in the background, a health check after the start
    while True:
        before = statuses(c)
        assert_matches_reference(c, PROMPTS[1])
        gained = grown(before, statuses(c))
        if all(g.get("link_messages", 0) > 0 for g in gained.values()) or time.monotonic() > deadline:
            break
    assert {node: g.get("link_messages", 0) > 0 for node, g in gained.items()} == dict.fromkeys(gained, True)
    assert {node: g.get("link_refused", 0) for node, g in gained.items()} == dict.fromkeys(gained, 0)
    # the messages of decode steps are packed (node/grpc/link/packed.py)
    packed = {node: g.get("link_packed", 0) for node, g in gained.items()}
    assert {node: 0 < n <= gained[node]["link_messages"] for node, n in packed.items()} == dict.fromkeys(gained, True)
    # and each node's engine thread took its decode rows' inputs as they came off the link (node/runtime/relay.py)
    assert {node: g.get("relayed_rows", 0) > 0 for node, g in gained.items()} == dict.fromkeys(gained, True)
    # the short way, where nothing but the checks applies (node/grpc/link/packed.py's `unpack_row`)
    assert {node: g.get("link_rows", 0) > 0 for node, g in gained.items()} == dict.fromkeys(gained, True)
    # which each node ran on the last row it took that way while it waited for the next (the link's `warm`)
    assert {node: g.get("link_warmed", 0) > 0 for node, g in gained.items()} == dict.fromkeys(gained, True)
    # and laid out its next relayed pass while the input was on its way (node/runtime/engine_step.py `lay_ahead`)
    assert {node: g.get("ahead_passes", 0) > 0 for node, g in gained.items()} == dict.fromkeys(gained, True)
    # whose rows went on from the engine thread as their pass ended, hidden rows to the next node and the last
    # node's tokens back to the first, the entry (node/runtime/early_send.py)
    assert {node: g.get("written_rows", 0) > 0 for node, g in gained.items()} == dict.fromkeys(gained, True)
    assert set(c.wait_idle().values()) == {0}


def test_a_ring_told_no_link_keeps_to_the_grpc_stream():
    with Cluster(MODEL, 2, shards=["0:3", "3:6"], extra=["--no-link"]) as c:
        for _ in range(3):
            assert_matches_reference(c, PROMPTS[0], max_tokens=12)
        assert [s for s in statuses(c).values() if "link_messages" in s] == []
        # the stream's inputs are relayed to a waiting engine thread as the link's are
        assert all(s.get("relayed_rows", 0) > 0 for s in statuses(c).values())
        assert all("data link" not in "".join(node.lines) for node in c.nodes)


def test_a_ggml_ring_lays_its_relayed_steps_out_ahead_and_answers_as_one_node_does():
    """The default engine (ggml) on a two-node ring lays out each relayed pass, its step included, while the input
    is on its way (node/runtime/engine_step.py `lay_ahead`, shards/engines/ggml/next_row.py), and answers token for
    token as one node running the whole model on the same engine."""
    with Cluster(MODEL, 1, engine=None) as one:
        want = [one.chat(p, max_tokens=24, temperature=0)[1]["choices"][0]["message"]["content"] for p in PROMPTS[:2]]
    with Cluster(MODEL, 2, shards=["0:3", "3:6"], engine=None) as c:
        before = statuses(c)
        got = [c.chat(p, max_tokens=24, temperature=0)[1]["choices"][0]["message"]["content"] for p in PROMPTS[:2]]
        gained = grown(before, statuses(c))
    assert got == want
    assert {node: g.get("ahead_steps", 0) > 20 for node, g in gained.items()} == dict.fromkeys(gained, True)


def test_automatic_partitioning_weights_layers_by_speed():
    with Cluster(MODEL, 3, memory_gb=[4, 2, 2], per_node=[["--speed", "2"], ["--speed", "1"], ["--speed", "1"]]) as c:
        assert_matches_reference(c, PROMPTS[2])
        # node0 at twice the speed takes the most layers (node2's one carries the head); memory only caps
        assert loaded_shards(c) == {"node0": ["llama[0:3/6]"], "node1": ["llama[3:5/6]"], "node2": ["llama[5:6/6]"]}
        assert set(c.wait_idle().values()) == {0}


def test_a_node_joins_its_peers_with_its_speed_already_measured():
    """A node that holds its weights times them before it joins: the first plan counting it has its speed, so the
    ring doesn't move under the first requests when the measure comes in (it moved twice in a host's first 7 s)."""
    ports = [free_port(), free_port()]
    with Cluster(MODEL, 1, static_peers=False, ports=ports[:1], per_node=[["--peers", f"127.0.0.1:{ports[1]}"]]) as c:
        late = Cluster(MODEL, 1, static_peers=False, ports=ports[1:], calibrate=True)
        late.per_node = [["--node-id", "late", "--peers", f"127.0.0.1:{ports[0]}"]]
        seen = []
        with ThreadPoolExecutor(1) as pool:
            started = pool.submit(late.__enter__)
            while not started.done():  # every view node0 has of it while it starts
                nodes = {n["node_id"]: n for n in c.topology()["nodes"]}
                if "late" in nodes:
                    seen.append(nodes["late"]["capabilities"]["speed"])
                time.sleep(0.02)
            started.result()
        try:
            deadline = time.monotonic() + 30
            while not seen and time.monotonic() < deadline:
                nodes = {n["node_id"]: n for n in c.topology()["nodes"]}
                seen += [nodes["late"]["capabilities"]["speed"]] if "late" in nodes else []
            assert seen and min(seen) > 0, seen
        finally:
            late.__exit__(None, None, None)


def test_concurrent_requests_each_equal_their_single_node_result():
    with Cluster(MODEL, 3, shards=["0:1", "1:4", "4:6"]) as c:
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(c.chat, p, max_tokens=16 + 4 * i, temperature=0) for i, p in enumerate(PROMPTS)]
            results = [f.result() for f in futures]
        for i, (prompt, (status, body)) in enumerate(zip(PROMPTS, results)):
            assert status == 200, body
            assert body["choices"][0]["message"]["content"] == reference(prompt, 16 + 4 * i)[0]
        stats = {node_id: info["status"] for node_id, info in c.self_info().items()}
        assert set(c.wait_idle().values()) == {0}
        # the pipeline batched: some forward passes carried more than one request
        assert any(s["step_rows"] > s["steps"] for s in stats.values())


def test_single_node_takes_the_same_ring_path():
    with Cluster(MODEL, 1) as c:
        assert_matches_reference(c, PROMPTS[3], max_tokens=32)
        assert set(c.wait_idle().values()) == {0}


def test_pinned_ranges_that_do_not_tile_fail_with_the_uncovered_layers():
    with Cluster(MODEL, 2, shards=["0:2", "3:6"]) as c:
        status, body = c.chat("hi", max_tokens=4)
        assert status == 503
        assert "layer 2 is not covered" in body["error"]["message"]


def test_a_dead_node_fails_the_request_quickly_and_cleanly():
    with Cluster(MODEL, 3, shards=["0:2", "2:4", "4:6"]) as c:
        c.nodes[1].proc.kill()
        c.nodes[1].proc.wait()
        started = time.monotonic()
        status, body = c.chat("hi", max_tokens=4)
        # pinned shards: no other node holds layers 2-3, so no replay can help; the error names them at once
        assert status == 503 and "layers 2-3 are not covered" in body["error"]["message"]
        assert time.monotonic() - started < 5
        assert c.active_requests()["node0"] == 0 or c.wait_idle()["node0"] == 0


def test_client_disconnect_cancels_the_request_on_every_node(live_cluster):
    import json
    import urllib.request

    c = live_cluster
    before = statuses(c)
    body = json.dumps(
        {
            "model": "llama",
            "messages": [{"role": "user", "content": "go on"}],
            "max_tokens": 200,
            "temperature": 0.8,
            "seed": 1,
            "stream": True,
        }
    ).encode()
    req = urllib.request.Request(
        f"{c.nodes[0].api_url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    response = urllib.request.urlopen(req, timeout=30)
    assert response.readline().startswith(b"data: ")
    response.close()  # the client goes away mid-stream
    assert set(c.wait_idle().values()) == {0}
    gained = grown(before, statuses(c)).values()
    assert all(s.get("ended_cancelled", 0) + s.get("ended_finished", 0) <= 1 for s in gained)
    assert any(s.get("ended_cancelled") for s in gained)


def test_sigterm_stops_a_node_cleanly():
    import signal

    with Cluster(MODEL, 1) as c:
        c.nodes[0].proc.send_signal(signal.SIGTERM)
        assert c.nodes[0].proc.wait(timeout=15) == 0


def test_eight_concurrent_streams_batch_their_sampling_and_equal_sequential_runs(live_cluster):
    import openai

    def stream(client, i):
        kw = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": i, "top_p": 0.9}
        chunks = client.chat.completions.create(
            model="llama",
            messages=[{"role": "user", "content": f"Story number {i}:"}],
            max_tokens=20,
            stream=True,
            **kw,
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    c = live_cluster
    client = openai.OpenAI(base_url=f"{c.nodes[0].api_url}/v1", api_key="x", max_retries=0)
    before = statuses(c)
    sequential = [stream(client, i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(lambda i: stream(client, i), range(8)))
    assert concurrent == sequential
    counters = grown(before, statuses(c))
    # whether a pass leaves rows to the next micro-batch depends on how the streams' arrivals interleave (none did
    # once on a slower CPU): tests/unit/test_microbatches.py specifies the micro-batches
    last = counters["node2"]  # node2 holds the last layers: it samples
    sizes = {int(k.rsplit("_", 1)[1]): v for k, v in last.items() if k.startswith("sample_batch_size_") and v}
    assert max(sizes) > 1, sizes
    assert last.get("sample_fallbacks", 0) == 0
    # every row was sampled on the engine thread right after its pass (Pipeline._presampler), none went round
    assert last.get("presampled_rows") == last["sample_items"] > 0
    assert set(c.wait_idle().values()) == {0}


def test_manual_discovery_file_and_wait_for_peers(tmp_path):
    import json

    from tests.support.cluster import free_port

    ports = [free_port() for _ in range(3)]
    peers = tmp_path / "peers.json"
    peers.write_text(
        json.dumps({"peers": [{"id": f"node{i}", "address": "127.0.0.1", "port": p} for i, p in enumerate(ports)]})
    )
    extra = ["--discovery", "manual", "--discovery-config", str(peers), "--wait-for-peers", "2"]
    with Cluster(MODEL, 3, shards=["0:2", "2:4", "4:6"], static_peers=False, ports=ports, extra=extra) as c:
        # --wait-for-peers 2: the ready lines came only once both other nodes were known
        assert all(len(c.topology(n)["nodes"]) == 3 for n in c.nodes)
        assert_matches_reference(c, PROMPTS[0])


def test_mixed_engine_ring_equals_one_numpy_node():
    """numpy -> mlx -> tinygrad: activations cross the wire as numpy float32 whatever the engine; the last node
    (tinygrad, which has no batched sampler) samples concurrent rows through the batcher's per-request fallback."""
    engines = [["--engine", "numpy"], ["--engine", "mlx"], ["--engine", "tinygrad"]]
    with Cluster(MODEL, 3, shards=["0:2", "2:4", "4:6"], per_node=engines) as c:
        assert [c.self_info()[f"node{i}"]["capabilities"]["engine"] for i in range(3)] == ["numpy", "mlx", "tinygrad"]
        assert_matches_reference(c, PROMPTS[0], max_tokens=16)
        with ThreadPoolExecutor(4) as pool:
            # logprobs keep the rows' logits for the sampler (greedy rows alone are picked by the engine)
            futures = [pool.submit(c.chat, p, max_tokens=12, temperature=0, logprobs=True) for p in PROMPTS]
            results = [f.result() for f in futures]
        for prompt, (status, body) in zip(PROMPTS, results):
            assert status == 200 and body["choices"][0]["message"]["content"] == reference(prompt, 12)[0]
        last = c.self_info()["node2"]["status"]
        assert last.get("sample_fallbacks", 0) > 0  # rows batched together, sampled one by one
        assert set(c.wait_idle().values()) == {0}


def test_a_ggml_node_continues_a_numpy_node():
    """numpy (layers 0-2) -> ggml (3-5, the node's default engine here: `auto` picks ggml when installed): hidden
    states cross the wire as float32, and the answer is that of the same two engines chained in one process."""
    from shards.engines.registry import engine_class

    ggml = engine_class("ggml")
    cfg, tok = ModelConfig.from_dir(MODEL), Tokenizer(MODEL)
    chain = [NumpyEngine(MODEL, Shard("llama", 0, 3, 6), cfg), ggml(MODEL, Shard("llama", 3, 6, 6), cfg, threads=1)]
    ids = [
        r.token
        for r in generate(
            chain, tok.encode_chat([{"role": "user", "content": PROMPTS[0]}]), 16, eos_ids=tok.eos_token_ids
        )
    ]
    with Cluster(
        MODEL, 2, shards=["0:3", "3:6"], per_node=[["--engine", "numpy"], ["--threads", "1"]], engine=None
    ) as c:
        assert [c.self_info()[f"node{i}"]["capabilities"]["engine"] for i in range(2)] == ["numpy", "ggml"]
        status, body = c.chat(PROMPTS[0], max_tokens=16, temperature=0)
        assert status == 200 and body["choices"][0]["message"]["content"] == tok.decode(ids)
        assert set(c.wait_idle().values()) == {0}


def test_bundled_demo_model_gives_the_same_text_on_three_nodes():
    from node.cli import DEMO_MODEL

    prompt = "And God said, Let there be"
    cfg, tok = ModelConfig.from_dir(DEMO_MODEL), Tokenizer(DEMO_MODEL)
    engine = NumpyEngine(DEMO_MODEL, Shard.whole("exo-demo", cfg.n_layers), cfg)
    ids = [
        r.token
        for r in generate(
            [engine], tok.encode_chat([{"role": "user", "content": prompt}]), 40, eos_ids=tok.eos_token_ids
        )
    ]
    with Cluster(DEMO_MODEL, 3) as c:  # automatic partitioning
        status, body = c.chat(prompt, max_tokens=40, temperature=0)
        assert status == 200 and body["model"] == "exo-demo"
        assert body["choices"][0]["message"]["content"] == tok.decode(ids)
        assert all(info["loaded"] for info in c.self_info().values())  # every node took a share
