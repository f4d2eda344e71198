"""Download once: a fresh 3-node loopback cluster where only node0 has the model's files.

    uv run python -m bench.bench_fetch [--models smollm2,llama357m] [--out FILE.md]

For each model: node0 starts with the files, node1 and node2 with just the model's id and an empty --models-dir
(all three report the same memory, so the layers split evenly); then, as the baseline, all three with the files.
Times are from the start of the processes: their APIs ready, the first answer (asked of node1 as soon as it is up;
whichever nodes hold their layers by then compute it), every node's view having all three in the plan, and an
answer through all three. Per fetching node: the bytes it received, its shard's bytes (with the config, tokenizer
and headers), the model's size and its time spent fetching (metadata + layers).

SmolLM2 is the packaged GGUF, served under the id `smollm2-135m-q4_1` from a copy in a temporary folder (the
packaged model's own id would resolve to the installed file on the fetching nodes too, as they share this machine).
The 357.6M model is bench/random_model.py's float32 Llama (1.43 GB safetensors), written to a temporary folder.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path

from bench.local_cluster import Cluster
from bench.random_model import write_random_llama
from node.fetch.layout import build_manifest
from shards.formats.loader import load_config
from shards.formats.packaged import resolve_model
from shards.model.shard import Shard

PROMPT = "Write a haiku about the sea."


def prepare(name: str, work: Path) -> tuple[Path, str]:
    if name == "smollm2":
        path = work / "smollm2-135m-q4_1.gguf"
        shutil.copy(resolve_model("smollm2")[0], path)
        return path, "smollm2-135m-q4_1"
    if name == "llama357m":
        return write_random_llama(work / "llama357m"), "llama357m"
    raise SystemExit(f"unknown model {name!r} (smollm2, llama357m)")


def run(path: Path, model_id: str, work: Path, fetching: bool = True, timeout: float = 600) -> dict:
    """One fresh cluster; `fetching`: only node0 has the files (else all three do, the baseline)."""
    n_layers = load_config(path).n_layers
    manifest = build_manifest(path, model_id, n_layers)
    fetch = [["--model", model_id, "--models-dir", str(work / f"node{i}"), "--wait-for-peers", "2"] for i in (1, 2)]
    per_node = [[], *fetch] if fetching else [["--wait-for-peers", "2"]] * 3
    started = time.monotonic()
    with Cluster(path, 3, per_node=per_node, model_id=model_id, memory_gb=[1, 1, 1]) as c:
        up = time.monotonic() - started
        ready: list[float] = []
        watcher = threading.Thread(target=lambda: ready.append(wait_for_full_plan(c, started, timeout)))
        watcher.start()
        status, body = c.chat(PROMPT, node=c.nodes[1], max_tokens=16, temperature=0)
        assert status == 200, body
        first = time.monotonic() - started
        watcher.join()
        status, body = c.chat(PROMPT, node=c.nodes[1], max_tokens=16, temperature=0)
        assert status == 200, body
        full = time.monotonic() - started
        info = c.self_info()
        nodes = {}
        for step in c.topology()["plan"]:
            shard = Shard(model_id, step["start"], step["end"], n_layers)
            s = info[step["node_id"]]["status"]
            nodes[step["node_id"]] = {
                "layers": f"{step['start']}-{step['end'] - 1}",
                "received": s.get("fetch_bytes_received", 0),
                "shard_bytes": manifest.nbytes(manifest.needed(shard)),
                "fetch_s": s.get("fetch_ms", 0) / 1000,
            }
    return {
        "model": model_id,
        "fetching": fetching,
        "model_bytes": manifest.nbytes(),
        "up_s": up,
        "first_answer_s": first,
        "all_ready_s": ready[0],
        "full_answer_s": full,
        "nodes": nodes,
    }


def wait_for_full_plan(c: Cluster, started: float, timeout: float) -> float:
    """Seconds from the start until every node's view has all three nodes in the plan."""
    while True:
        plans = [c.topology(node)["plan"] or [] for node in c.nodes]
        if len(plans[0]) == 3 and all(p == plans[0] for p in plans):
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise SystemExit(f"not ready after {timeout}s: {plans}")
        time.sleep(0.1)


def table(results: list[dict]) -> str:
    lines = [
        "| model | node | layers | bytes received | its shard (+ metadata) | model | fetch time |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r["fetching"]:
            continue
        for node_id, n in r["nodes"].items():
            lines.append(
                f"| {r['model']} | {node_id} | {n['layers']} | {n['received'] / 1e6:.1f} MB | "
                f"{n['shard_bytes'] / 1e6:.1f} MB | {r['model_bytes'] / 1e6:.1f} MB | "
                + (f"{n['fetch_s']:.1f} s |" if n["received"] else "(has the files) |")
            )
    lines += [
        "",
        "| model | files on | nodes up (APIs ready) | first answer | all 3 in the plan | first answer through all 3 |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['model']} | {'node0 only' if r['fetching'] else 'all 3 nodes'} | {r['up_s']:.1f} s | "
            f"{r['first_answer_s']:.1f} s | {r['all_ready_s']:.1f} s | {r['full_answer_s']:.1f} s |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,llama357m")
    ap.add_argument("--out", type=Path, help="also write the tables (markdown) here")
    args = ap.parse_args()
    results = []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="bench-fetch-") as tmp:
            path, model_id = prepare(name, Path(tmp))
            for fetching in (True, False):
                results.append(run(path, model_id, Path(tmp) / ("fetch" if fetching else "baseline"), fetching))
                print(results[-1], flush=True)
    text = table(results)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
