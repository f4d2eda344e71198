"""Download once, on live nodes over loopback: of three nodes only node0 has the model; the other two start with
just its id, fetch their own layers from node0, and the cluster answers exactly as one process holding the model.
Each fetching node receives the bytes of its own shard (plus the config, tokenizer and file headers), not the
model; until the nodes hold their layers, requests are served without them."""

import subprocess
import sys
import time
from pathlib import Path

from node.fetch.layout import build_manifest
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.loader import load_config
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard
from shards.reference.generate import generate
from tests.conftest import FIXTURES
from tests.support.cluster import ROOT, Cluster

PROMPT = "The capital of France is"
# A fetching node receives its shard's pieces and the metadata; retries (a piece cut off by a plan change) may add
# a little. More than this over its shard would mean it fetched what it doesn't serve.
MARGIN = 0.10


def reference(model: Path, model_id: str, prompt: str, max_tokens: int) -> str:
    """The text one process holding the whole model gives (itself proven against transformers elsewhere)."""
    cfg, tok = load_config(model), Tokenizer.load(model)
    engine = NumpyEngine(model, Shard.whole(model_id, cfg.n_layers), cfg)
    ids = [
        r.token
        for r in generate(
            [engine], tok.encode_chat([{"role": "user", "content": prompt}]), max_tokens, eos_ids=tok.eos_token_ids
        )
    ]
    return tok.decode(ids)


def wait_for_full_plan(c: Cluster, n: int, timeout: float = 60) -> list[dict]:
    """The plan once every node's view has all `n` nodes in it (each learns of its peers' readiness from its own
    health checks, so views converge within a second or so of each other)."""
    deadline = time.monotonic() + timeout
    while True:
        plans = [c.topology(node)["plan"] or [] for node in c.nodes]
        if len(plans[0]) == n and all(plan == plans[0] for plan in plans):
            return plans[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"the fetching nodes never became ready: {plans}")
        time.sleep(0.2)


def fetching_cluster(model: Path, model_id: str, tmp_path: Path, extra0: list[str] = ()) -> Cluster:
    fetch = [["--model", model_id, "--models-dir", str(tmp_path / f"node{i}"), "--wait-for-peers", "2"] for i in (1, 2)]
    # equal memory: the same split every time (by default it follows each node's free memory at its start)
    return Cluster(model, 3, per_node=[list(extra0), *fetch], model_id=model_id, memory_gb=[1, 1, 1])


def check_bytes(c: Cluster, model: Path, model_id: str, plan: list[dict]) -> dict[str, tuple[int, int]]:
    """Each fetching node received the pieces of its shard (and the metadata), within MARGIN; returns
    node id -> (received, shard's bytes)."""
    manifest = build_manifest(model, model_id, load_config(model).n_layers)
    status = {node_id: info["status"] for node_id, info in c.self_info().items()}
    out = {}
    for step in plan:
        if step["node_id"] == "node0":
            continue
        shard = Shard(model_id, step["start"], step["end"], manifest.n_layers)
        expected = manifest.nbytes(manifest.needed(shard))
        received = status[step["node_id"]]["fetch_bytes_received"]
        assert expected <= received <= expected * (1 + MARGIN), (step, received, expected)
        out[step["node_id"]] = (received, expected)
    assert sum(r for r, _ in out.values()) < manifest.nbytes() + manifest.nbytes(manifest.metadata())
    assert status["node0"]["upload_bytes"] == sum(r for r, _ in out.values())
    return out


def test_two_nodes_fetch_their_layers_of_a_safetensors_model_and_answer_as_one_process(tmp_path, capsys):
    model = FIXTURES / "llama"
    expected = reference(model, "llama", PROMPT, 24)
    started = time.monotonic()
    # node0 uploads slowly (2 Mbit/s) so that the first request below arrives while the others still fetch
    with fetching_cluster(model, "llama", tmp_path, ["--max-upload-mbps", "2"]) as c:
        # they wait 2 s for the membership to settle, then fetch for ~2 s: this request comes before that
        assert c.topology(c.nodes[1])["plan"] == [{"node_id": "node0", "start": 0, "end": 6}]
        status, body = c.chat(PROMPT, node=c.nodes[1], max_tokens=24, temperature=0)  # a fetching node as entry
        first_answer = time.monotonic() - started
        assert status == 200 and body["choices"][0]["message"]["content"] == expected
        plan = wait_for_full_plan(c, 3)
        ready = time.monotonic() - started
        assert {s["node_id"] for s in plan} == {"node0", "node1", "node2"}
        for node in c.nodes:
            status, body = c.chat(PROMPT, node=node, max_tokens=24, temperature=0)
            assert status == 200 and body["choices"][0]["message"]["content"] == expected
        sizes = check_bytes(c, model, "llama", plan)
        loaded = {node_id: info["loaded"] for node_id, info in c.self_info().items()}
        assert all(f"llama[{s['start']}:{s['end']}/6]" in loaded[s["node_id"]] for s in plan), (plan, loaded)
        notes = {n["node_id"]: n["availability"] for n in c.topology()["nodes"]}
        assert notes["node1"]["note"] == "" and notes["node0"]["complete"]
    with capsys.disabled():
        print(
            f"\n[fetch] safetensors: first answer {first_answer:.1f}s after start (during the fetch), all 3 nodes "
            f"in the plan after {ready:.1f}s; received/shard bytes: {sizes}"
        )


def test_nodes_fetch_their_layers_of_a_tied_gguf_model_and_reuse_them_after_a_restart(tmp_path):
    model = FIXTURES / "gguf" / "qwen2.gguf"  # 3 layers, tied embeddings: the last shard fetches the embedding
    expected = reference(model, "qwen2", PROMPT, 16)
    with fetching_cluster(model, "qwen2", tmp_path) as c:
        plan = wait_for_full_plan(c, 3)
        status, body = c.chat(PROMPT, max_tokens=16, temperature=0)
        assert status == 200 and body["choices"][0]["message"]["content"] == expected
        check_bytes(c, model, "qwen2", plan)
    # restarted, the nodes find their copies: nothing is fetched again, and they are in the plan at once
    with fetching_cluster(model, "qwen2", tmp_path) as c:
        assert len(wait_for_full_plan(c, 3, timeout=10)) == 3
        status, body = c.chat(PROMPT, node=c.nodes[2], max_tokens=16, temperature=0)
        assert status == 200 and body["choices"][0]["message"]["content"] == expected
        received = [info["status"]["fetch_bytes_received"] for info in c.self_info().values()]
        assert received == [0, 0, 0]


def test_a_node_without_the_model_waits_for_a_peer_and_says_so_but_a_missing_path_is_an_error(tmp_path):
    base = [
        sys.executable,
        "-m",
        "node.cli",
        "--grpc-port",
        "0",
        "--no-api",
        "--discovery",
        "none",
        "--models-dir",
        str(tmp_path),
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(
        [*base, "--model", "llama"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        line = ""
        deadline = time.monotonic() + 20
        while "waiting for a peer" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
        assert "waiting for a peer that has all of llama" in line
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    done = subprocess.run([*base, "--model", "./no/such/model"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no such file or folder" in done.stderr


def test_three_nodes_serve_a_split_gguf_fetching_only_their_parts_bytes(tmp_path):
    """A Llama 3.1-style GGUF in three gguf-split parts: node0 has them, the others fetch their layers' bytes (and
    every part's header) and the cluster answers as one process holding the unsplit file."""
    from tests.support.gguf_util import split_gguf

    whole = FIXTURES / "gguf" / "llama31.gguf"
    model = split_gguf(whole, tmp_path / "split", max_tensors=20)
    expected = reference(whole, "llama31", PROMPT, 16)
    with fetching_cluster(model, "llama31", tmp_path) as c:
        plan = wait_for_full_plan(c, 3)
        status, body = c.chat(PROMPT, node=c.nodes[2], max_tokens=16, temperature=0)
        assert status == 200 and body["choices"][0]["message"]["content"] == expected
        check_bytes(c, model, "llama31", plan)
