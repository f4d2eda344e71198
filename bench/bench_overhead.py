"""Time outside the engine, from the nodes' own counters (node/runtime/overhead.py): per token at one stream, per
step at 8 streams on one node, and per hop on a two-node ring (bench/bench_microbatch.py's SPLIT of the packaged
model: the planner's), at one stream and at 8 (`ring8`).

    uv run python -m bench.bench_overhead [--tokens 64] [--streams 8] [--threads 1] [--engine auto]
        [--node-args "--quantize none"] [--pin] [--only one,eight,ring,ring8,floor] [--model FILE.gguf]

Each case starts its nodes (the packaged SmolLM2, the default engine unless --engine), sends one warm-up request,
reads the counters, runs its streams (greedy chat, --tokens each, speculation off so one pass is one token) and
prints the counters' differences: the mean time between two passes on the engine thread, less the waits for work
(`outside_ms_per_pass`), beside the engine's own mean pass (`forward_ms_per_pass`); on the ring, each node's
sending side (pass end -> transport call), the call itself (serialise, gRPC, the peer's taking it, its answer) and
the receiving side (arrival -> the pass that runs it), each split into its stages (`*_ms`, node/runtime/overhead.py).
`floor` is what none of the node's counters sees: gRPC's one-way time for a decode step's message between two bare
processes (bench/grpc_floor.py). `--pin` puts each node (and each floor process) on a core of its own, as two
one-core machines. The load average is printed with the figures: the machine may be shared, and then the figures
mean little.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import time
from pathlib import Path

import aiohttp

from bench import grpc_floor
from bench.bench_microbatch import SPLIT, pin
from bench.local_cluster import Cluster, free_port
from shards.formats.packaged import DEFAULT_MODEL, resolve_model

KEYS = (
    "outside_us_total",
    "outside_passes",
    "forward_us_total",
    "steps",
    "hop_in_us_total",
    "hop_in",
    "hop_out_us_total",
    "hop_out",
    "hop_send_us_total",
    "hop_sends",
    "followed_rows",
    "relayed_rows",
    "link_warmed",
    "ahead_passes",
    "ahead_steps",
    "loop_wake_us_total",
    "loop_wakes",
    "hop_write_us_total",
    "hop_writes",
    "hop_accept_us_total",
    "hop_accepts",
    "hop_queue_us_total",
    "hop_queued",
    "engine_wake_us_total",
    "engine_wakes",
    "cpu_outside_us_total",
    "cpu_engine_us_total",
    "cpu_passes",
)


async def stream(session: aiohttp.ClientSession, url: str, model: str, i: int, tokens: int) -> int:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"Write a long story about a lighthouse keeper (#{i})."}],
        "stream_options": {"include_usage": True},  # a chunk carries every token that came while the last was sent
    }
    n = 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data: {") and b'"usage"' in line:
                n = json.loads(line[6:])["usage"]["completion_tokens"]
    return n


async def counters(session: aiohttp.ClientSession, url: str) -> dict[str, int]:
    async with session.get(f"{url}/v1/topology") as r:
        status = (await r.json())["nodes"][0]["status"]
    return {k: int(status.get(k, 0)) for k in KEYS}


def loop_cpu_s(pid: int) -> float:
    """CPU seconds the process's main thread (the node's event loop) has used, from /proc (0 where there is none)."""
    try:
        fields = open(f"/proc/{pid}/task/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def measure(urls: list[str], model: str, streams: int, tokens: int, pids: list[int]) -> dict:
    """Counters' differences on every node (`urls`, the entry first; `pids` its processes) over `streams` concurrent
    requests."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        await stream(session, urls[0], model, -1, 8)  # warm-up: graphs built, caches sized
        before = [await counters(session, u) for u in urls]
        loop_before = [loop_cpu_s(p) for p in pids]
        started = time.perf_counter()
        got = await asyncio.gather(*(stream(session, urls[0], model, i, tokens) for i in range(streams)))
        wall = time.perf_counter() - started
        loop_after = [loop_cpu_s(p) for p in pids]
        after = [await counters(session, u) for u in urls]
    nodes = []
    for b, a, l0, l1 in zip(before, after, loop_before, loop_after):
        d = {k: a[k] - b[k] for k in KEYS}
        ms = lambda total, count: round(d[total] / max(1, d[count]) / 1000, 3)  # noqa: E731
        nodes.append(
            {
                "passes": d["outside_passes"],
                "followed_rows": d["followed_rows"],  # rows the engine thread ran on by itself
                "relayed_rows": d["relayed_rows"],  # inputs handed straight to a waiting engine thread
                "link_warmed": d["link_warmed"],  # the link's short way run on its last row while waiting
                "ahead": (d["ahead_passes"], d["ahead_steps"]),  # relayed passes laid out before their inputs came
                "outside_ms_per_pass": ms("outside_us_total", "outside_passes"),
                "forward_ms_per_pass": ms("forward_us_total", "steps"),
                "hop_out_ms": ms("hop_out_us_total", "hop_out"),
                "hop_send_ms": ms("hop_send_us_total", "hop_sends"),
                "hop_in_ms": ms("hop_in_us_total", "hop_in"),
                # the hop's stages (node/runtime/overhead.py), in the order a token lives them
                "loop_wake_ms": ms("loop_wake_us_total", "loop_wakes"),
                "hop_write_ms": ms("hop_write_us_total", "hop_writes"),
                "hop_accept_ms": ms("hop_accept_us_total", "hop_accepts"),
                "hop_queue_ms": ms("hop_queue_us_total", "hop_queued"),
                "engine_wake_ms": ms("engine_wake_us_total", "engine_wakes"),
                # CPU time (meaningful on a loaded machine too): the process less its engine thread, per pass
                "cpu_outside_ms_per_pass": ms("cpu_outside_us_total", "cpu_passes"),
                "cpu_engine_ms_per_pass": ms("cpu_engine_us_total", "cpu_passes"),
                # the event loop's thread alone (HTTP, the core, hand-offs), per pass: clock ticks, so over many
                "loop_cpu_ms_per_pass": round((l1 - l0) * 1000 / max(1, d["outside_passes"]), 3),
            }
        )
    return {"streams": streams, "tokens": sum(got), "wall_s": round(wall, 2), "nodes": nodes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--engine", default=None)
    p.add_argument("--node-args", default="", help='more node flags, e.g. "--quantize none"')
    p.add_argument("--pin", action="store_true", help="every node's threads on a core of their own (taskset)")
    p.add_argument("--only", default="one,eight,ring", help="which cases: one, eight, ring, ring8, floor")
    p.add_argument("--model", type=Path, help="a GGUF file to serve instead of the packaged model")
    args = p.parse_args()
    path, model_id = (args.model, args.model.stem) if args.model else resolve_model(DEFAULT_MODEL)
    extra = ["--threads", str(args.threads), "--speculate", "off", *shlex.split(args.node_args)]
    split = None if args.model else SPLIT  # another model: the planner's split (the file's head weight)
    cases = {
        "one": (1, None, 1),  # nodes, shards, streams
        "eight": (1, None, args.streams),
        "ring": (2, split, 1),
        "ring8": (2, split, args.streams),
    }
    for name in args.only.split(","):
        if name == "floor":  # gRPC's own one-way time for the ring's message, between two bare processes
            result = grpc_floor.measure(free_port(), pinned=args.pin)
            print(json.dumps({"case": name, **result, "load": os.getloadavg()}), flush=True)
            continue
        n, shards, streams = cases[name]
        with Cluster(path, n, shards=shards, model_id=model_id, engine=args.engine, extra=extra) as c:
            if args.pin:  # each node a one-core machine, as bench_rpc's are
                for core, node in enumerate(c.nodes):
                    pin(node.proc.pid, core % os.cpu_count())
            urls = [node.api_url for node in c.nodes]
            result = asyncio.run(measure(urls, model_id, streams, args.tokens, [node.proc.pid for node in c.nodes]))
        print(json.dumps({"case": name, **result, "load": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()
