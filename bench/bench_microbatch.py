"""Micro-batches round a ring: a ring of single-core nodes against one such node, with and without them.

    uv run python -m bench.bench_microbatch [--streams 8] [--tokens 96] [--rounds 2] [--micro-batches 1,0]

A ring is for machines that compute at the same time; on one machine its nodes share the cores. So this pins every
process to a core of its own (`taskset`, Linux): one exo node alone on core 0 (one thread) stands for one machine,
and a 2-node ring with a node on core 0 and one on core 1 (one thread each) for two such machines on a LAN (loopback
here). The split is the planner's for two such nodes (node/core/placement/): SmolLM2's output head (49152 x 576,
tied to the embedding) costs about what five of its layers do on one core of the Intel Xeon these figures come from
(the head weight its nodes measure, 0.75-0.81), so the last node takes fewer layers (0:18 and 18:30).

Per setting: N concurrent greedy streams of --tokens (bench/bench_serve.py's client; new prompts each round), the
aggregate tok/s of every round. `--micro-batches 1` is one batch of every stream round the ring: one node computes
while the other waits; the default (0: one batch per node) keeps both computing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.bench_serve import concurrent
from bench.local_cluster import Cluster
from shards.formats.packaged import resolve_model

SPLIT = ["0:18", "18:30"]  # SmolLM2: the last node also computes the output head (~5 layers' worth here)


def pin(pid: int, core: int) -> None:
    """Every thread of process `pid` on CPU `core` only."""
    subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(pid)], capture_output=True, check=True)


def run(nodes: int, micro_batches: int, args) -> dict:
    model, model_id = resolve_model("smollm2")
    extra = ["--quantize", "none", "--threads", "1", "--micro-batches", str(micro_batches)]
    shards = SPLIT if nodes == 2 else None
    with Cluster(model, nodes, shards=shards, api_nodes=1, model_id=model_id, engine=None, extra=extra) as c:
        for core, node in enumerate(c.nodes):
            pin(node.proc.pid, core)
        url = c.nodes[0].api_url
        asyncio.run(concurrent(url, model_id, 1, 4, -1))  # warm up: graphs, the first prefill
        asyncio.run(concurrent(url, model_id, args.streams, 32, -2))
        rounds = [asyncio.run(concurrent(url, model_id, args.streams, args.tokens, r)) for r in range(args.rounds)]
    row = {
        "nodes": nodes,
        "micro_batches": micro_batches,
        "aggregate": [round(r["aggregate"], 1) for r in rounds],
        "load": round(os.getloadavg()[0], 1),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--micro-batches", default="1,0", help="the ring's --micro-batches values to compare")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs two CPUs: a node on each")
    rows = [run(1, 1, args)] + [run(2, int(m), args) for m in args.micro_batches.split(",")]
    alone = max(rows[0]["aggregate"])
    for row in rows[1:]:
        print(
            f"2-node ring, --micro-batches {row['micro_batches']}: best {max(row['aggregate']):.1f} tok/s = "
            f"{max(row['aggregate']) / alone:.2f}x one node ({alone:.1f})"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
