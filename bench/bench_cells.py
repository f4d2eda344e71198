"""The ggml engine's step at 8 and 64 concurrent requests: graph nodes per step, graph builds, step time.

    uv run python -m bench.bench_cells [--requests 8,64] [--threads 1] [--quantize none] [--tokens 16]
        [--burst-rounds 3] [--own-group-rows 64]

Engine level, on the packaged SmolLM2, each count of requests on a fresh engine: N short prompts prefilled in one
step, then --tokens decode steps of all N (`steady`), then --tokens decode steps where one request ends and a new one
(prefilled in the same step) takes its place each step (`churn`: what a busy node sees, every step a new set of
requests); with --burst-rounds, first N chat-sized prompts (36-44 tokens) prefilled in one pass, each round (what a
burst of new chats costs; --own-group-rows compares how many rows a prompt chunk needs to attend its own cells).
Reports per phase the mean and worst step time, how many graphs were built, and the nodes of the
decode graph. Runs against whatever tree it is run from, so the same script measures the code before a change (from
an export of the old commit) and after; the load average is printed with the figures (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import ggml.ggml as g  # noqa: E402  (after the engine, which loads and patches the binding)
import numpy as np

import shards.engines.ggml.layout as ggml_layout
from shards.engines.base import StepInput
from shards.engines.ggml.engine import GgmlEngine
from shards.formats.loader import load_config
from shards.formats.packaged import DEFAULT_MODEL, resolve_model
from shards.model.shard import Shard


def counting_builds(engine: GgmlEngine) -> list[int]:
    """Count every graph the engine builds (whatever its graph cache's version calls a graph's key)."""
    count, put = [0], engine.runner.graphs.put

    def counted(graph):
        count[0] += 1
        put(graph)

    engine.runner.graphs.put = counted
    return count


def timed(engine: GgmlEngine, batch: list[StepInput]) -> tuple[float, list[np.ndarray]]:
    t0 = time.perf_counter()
    out = engine.forward(batch)
    return time.perf_counter() - t0, out


def run(n: int, args) -> dict:
    path, _ = resolve_model(DEFAULT_MODEL)
    cfg = load_config(path)
    shard = Shard("m", 0, cfg.n_layers, cfg.n_layers)
    engine = GgmlEngine(path, shard, cfg, threads=args.threads, quantize=args.quantize, adapt_threads=False)
    builds = counting_builds(engine)
    rng = np.random.default_rng(n)
    reserve = 8 + 2 * args.tokens + 1

    def prompt(i: int) -> StepInput:
        return StepInput(f"r{i}", tokens=rng.integers(100, 5000, 8), max_positions=reserve)

    burst = []
    for r in range(args.burst_rounds):  # chat-sized prompts, all in one pass (a burst of new requests)
        chats = [StepInput(f"b{r}-{i}", tokens=rng.integers(100, 5000, 36 + i % 9), max_positions=64) for i in range(n)]
        burst.append(round(1e3 * timed(engine, chats)[0], 1))
        for c in chats:
            engine.release(c.request_id)
    live = list(range(n))
    prefill, out = timed(engine, [prompt(i) for i in live])
    last = {i: int(np.argmax(o[-1])) for i, o in zip(live, out)}
    phases, nodes = {}, None
    for phase in ("steady", "churn"):
        before, times = builds[0], []
        for step in range(args.tokens):
            batch = [StepInput(f"r{i}", tokens=np.array([last[i]])) for i in live]
            if phase == "churn":  # the oldest request ends, a new one arrives: a new set of requests every step
                engine.release(f"r{live[0]}")
                batch = batch[1:] + [prompt(n + step)]
                live = live[1:] + [n + step]
            seconds, out = timed(engine, batch)
            times.append(seconds)
            last = {i: int(np.argmax(o[-1])) for i, o in zip(live, out)}
        phases[phase] = {
            "step_ms_mean": round(1e3 * statistics.mean(times), 1),
            "step_ms_median": round(1e3 * statistics.median(times), 1),
            "step_ms_worst": round(1e3 * max(times), 1),
            "graphs_built": builds[0] - before,
        }
        if phase == "steady":  # the graph the last decode step ran (the most recently used)
            nodes = int(g.ggml_graph_n_nodes(list(engine.runner.graphs.graphs.values())[-1].gf))
    engine.close()
    return {
        "requests": n,
        "prefill_ms": round(1e3 * prefill, 1),
        "burst_ms": burst,  # N prompts of 36-44 tokens in one pass, each round
        "own_group_rows": ggml_layout.OWN_GROUP_ROWS,
        "decode_graph_nodes": nodes,
        **phases,
        "threads": args.threads,
        "load": os.getloadavg(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", default="8,64")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quantize", default="none", help="--quantize of the engine (none: the file's own Q4_1)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--burst-rounds", type=int, default=0, help="rounds of N chat-sized prompts in one pass")
    p.add_argument("--own-group-rows", type=int, help="override the engine's OWN_GROUP_ROWS (to compare values)")
    args = p.parse_args()
    if args.own_group_rows:
        ggml_layout.OWN_GROUP_ROWS = args.own_group_rows
    for n in (int(x) for x in args.requests.split(",")):
        print(json.dumps(run(n, args)), flush=True)


if __name__ == "__main__":
    main()
