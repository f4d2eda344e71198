"""A burst of concurrent requests at a fresh node: does any step cost far more than the
engine's usual step?

    uv run python -m bench.bench_burst [--requests 64] [--tokens 24] [--threads 1] [--runs 1] [--engine auto]
        [--node-args "--quantize none"]

Each run starts one node (the packaged SmolLM2, the default engine unless --engine), sends --requests streaming
chat requests at once (greedy, different prompts, --tokens each) the moment it is ready, and reports: the wall
time, tokens received, and the node's steps: count, mean and worst forward time (the engine computing) and step
time (as the pipeline saw it), read from its status counters and its exo_forward_step_seconds histogram. The load
average is printed with the figures (the machine may be shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import time

import aiohttp

from bench.local_cluster import Cluster
from shards.formats.packaged import DEFAULT_MODEL, resolve_model

TOPICS = [
    "rivers",
    "bridges",
    "tea",
    "volcanoes",
    "owls",
    "clocks",
    "maps",
    "glass",
    "salt",
    "kites",
    "bees",
    "ships",
    "paper",
    "lamps",
    "wool",
    "snow",
]


async def one(session: aiohttp.ClientSession, url: str, model: str, i: int, tokens: int) -> tuple[int, float]:
    """(tokens received, seconds to the first) of one streaming request."""
    body = {
        "model": model,
        "stream": True,
        "max_tokens": tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"Tell me one fact about {TOPICS[i % len(TOPICS)]} (#{i})."}],
        "stream_options": {"include_usage": True},  # a chunk may carry several tokens
    }
    started, first, n = time.perf_counter(), None, 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data: {") and b'"usage"' in line:
                n = json.loads(line[6:])["usage"]["completion_tokens"]
            elif line.startswith(b"data: {") and b'"content"' in line:
                first = first or time.perf_counter() - started
    return n, first or float("nan")


def histogram(metrics: str, name: str) -> dict[str, float]:
    out = {}
    for line in metrics.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


async def burst(url: str, model: str, n: int, tokens: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.perf_counter()
        results = await asyncio.gather(*(one(session, url, model, i, tokens) for i in range(n)))
        wall = time.perf_counter() - started
        async with session.get(f"{url}/v1/topology") as r:
            status = (await r.json())["nodes"][0]["status"]
        async with session.get(f"{url}/metrics") as r:
            metrics = await r.text()
    steps = histogram(metrics, "exo_forward_step_seconds")
    buckets = {k: v for k, v in steps.items() if "_bucket" in k}
    count = steps.get("exo_forward_step_seconds_count", 0)
    over_1s = count - next((v for k, v in buckets.items() if 'le="1.0"' in k), count)
    return {
        "requests": n,
        "wall_s": round(wall, 2),
        "tokens": sum(t for t, _ in results),
        "ttft_max_s": round(max(f for _, f in results), 2),
        "steps": status.get("steps"),
        "forward_mean_ms": round(status.get("forward_us_total", 0) / max(1, status.get("steps", 1)) / 1000, 1),
        "step_mean_ms": round(status.get("step_us_total", 0) / max(1, status.get("steps", 1)) / 1000, 1),
        "steps_over_1s": over_1s,
        "load": os.getloadavg(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--engine", default=None)
    p.add_argument("--node-args", default="", help='more node flags, e.g. "--quantize none"')
    args = p.parse_args()
    path, model_id = resolve_model(DEFAULT_MODEL)
    for run in range(args.runs):
        with Cluster(
            path,
            1,
            model_id=model_id,
            engine=args.engine,
            extra=["--threads", str(args.threads), *shlex.split(args.node_args)],
        ) as c:
            print(
                json.dumps({"run": run} | asyncio.run(burst(c.nodes[0].api_url, model_id, args.requests, args.tokens))),
                flush=True,
            )


if __name__ == "__main__":
    main()
