"""CPU time per token on each node of a two-node ring, thread by thread: what a hop costs, in the one measure that
stays meaningful on a shared machine (wall-clock tok/s is bench/bench_rpc.py's, on a quiet one).

    uv run python -m bench.bench_hop_cpu [--tokens 256] [--rounds 2] [--perf DIR | --profile DIR]

Two nodes (bench/bench_microbatch.py's SPLIT, the packaged SmolLM2 Q4_1, `--threads 1 --quantize none --speculate off`),
each pinned to its own core as bench/bench_rpc.py pins them, serve one greedy stream at a time. Around each
stream every thread's on-CPU time is read from the kernel (/proc/PID/task/TID/schedstat, nanoseconds), so the
figures are CPU time, not wall time: the busiest thread of a node is its engine thread (ggml computes on it, one
thread); everything else (MainThread: the event loop; event_engine and _poll_wrapper: gRPC's threads) is what the
node spends outside its engine. On one-core machines nothing overlaps, so that is what a hop adds to every token.
During the first `--profile-s` seconds of the last round, `--perf DIR` samples each node's CPU with `perf record`
(native frames: gRPC's C core, the kernel; `perf report --tid PID` for one thread), `--profile DIR` with py-spy
(`--gil`: the thread running Python; py-spy on PATH or in /tmp/pyspy-venv), raw stacks for flame graphs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

from bench.bench_microbatch import SPLIT, pin
from bench.bench_serve import concurrent
from bench.local_cluster import Cluster
from shards.formats.packaged import resolve_model


def thread_cpu(pid: int) -> dict[int, tuple[str, int]]:
    """tid -> (thread name, nanoseconds on a CPU so far) for every thread of `pid`."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
        out[int(task.name)] = (name, ns)
    return out


def python_names(pid: int) -> dict[int, str]:
    """tid -> the Python thread's name (MainThread: the event loop; engine_0: the engine), from `py-spy dump`; {}
    without py-spy (then threads go by their kernel names)."""
    found = shutil.which("py-spy") or "/tmp/pyspy-venv/bin/py-spy"
    if not Path(found).exists():
        return {}
    out = subprocess.run([found, "dump", "--nonblocking", "-p", str(pid)], capture_output=True, text=True).stdout
    return {int(m[0]): m[1] for m in re.findall(r"^Thread (\d+) \([^)]*\): \"([^\"]*)\"", out, re.M)}


def per_token(before: dict, after: dict, tokens: int, names: dict[int, str]) -> dict:
    """Each node's CPU ms per token: all of it, its engine thread's, and the rest by thread name."""
    used = {tid: ns - before.get(tid, (name, 0))[1] for tid, (name, ns) in after.items()}
    engine = max(used, key=used.get)
    rest: Counter[str] = Counter()
    for tid, ns in used.items():
        if tid != engine:
            rest[names.get(tid, after[tid][0])] += ns
    ms = lambda ns: round(ns / tokens / 1e6, 3)  # noqa: E731
    return {
        "cpu_ms": ms(sum(used.values())),
        "engine_ms": ms(used[engine]),
        "outside_ms": ms(sum(rest.values())),
        "outside_by_thread": {k: ms(v) for k, v in rest.most_common() if v},
    }


def pyspy() -> str:
    found = shutil.which("py-spy") or "/tmp/pyspy-venv/bin/py-spy"
    if not Path(found).exists():
        raise SystemExit(
            "--profile needs py-spy: python -m venv /tmp/pyspy-venv && /tmp/pyspy-venv/bin/pip install py-spy"
        )
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", type=Path, default=None, help="py-spy's raw stacks of each node go here")
    ap.add_argument("--perf", type=Path, default=None, help="`perf record` of each node goes here (CPU samples)")
    ap.add_argument("--profile-s", type=int, default=10, help="seconds py-spy samples (the stream must last longer)")
    ap.add_argument("--node-args", default="", help="more node flags")
    args = ap.parse_args()
    gguf, model_id = resolve_model("smollm2")
    extra = ["--quantize", "none", "--threads", "1", "--speculate", "off", *args.node_args.split()]
    with Cluster(gguf, 2, shards=SPLIT, api_nodes=1, model_id=model_id, engine=None, extra=extra) as c:
        for core, node in enumerate(c.nodes):
            pin(node.proc.pid, core)
        url, pids = c.nodes[0].api_url, [n.proc.pid for n in c.nodes]
        asyncio.run(concurrent(url, model_id, 1, 16, -1))  # warm up: graphs, the first prefill
        for r in range(args.rounds):
            spies = []
            if args.perf and r == args.rounds - 1:
                args.perf.mkdir(parents=True, exist_ok=True)
                for i, pid in enumerate(pids):
                    cmd = ["perf", "record", "-F", "499", "-g", "-p", str(pid), "-o", str(args.perf / f"node{i}.perf")]
                    cmd += ["--", "sleep", str(args.profile_s)]
                    spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
            if args.profile and r == args.rounds - 1:
                args.profile.mkdir(parents=True, exist_ok=True)
                for i, pid in enumerate(pids):
                    cmd = [pyspy(), "record", "--nonblocking", "-r", "250", "-f", "raw", "-d", str(args.profile_s)]
                    cmd += ["--gil"]  # samples only the thread holding the GIL: Python running, not waiting
                    cmd += ["-o", str(args.profile / f"node{i}.txt"), "-p", str(pid)]
                    spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
            before = [thread_cpu(p) for p in pids]
            got = asyncio.run(concurrent(url, model_id, 1, args.tokens, r))
            after = [thread_cpu(p) for p in pids]
            for spy in spies:
                spy.wait(timeout=60)
            tokens = got["chunks"]
            nodes = [per_token(b, a, tokens, names) for b, a, names in zip(before, after, map(python_names, pids))]
            total = sum(n["cpu_ms"] for n in nodes)
            print(
                json.dumps(
                    {
                        "round": r,
                        "tokens": tokens,
                        "cpu_ms_per_token": round(total, 3),
                        "outside_ms_per_token": round(sum(n["outside_ms"] for n in nodes), 3),
                        "nodes": nodes,
                        "wall_tok_s (shared machine: not a figure)": round(got["per_stream"], 1),
                        "load": os.getloadavg()[0],
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
