"""Decode speed through the HTTP API: a concurrency sweep on one node and on a 3-node loopback pipeline, and the
speed of one stream as the layers are split over 1-4 nodes.

    uv run --group bench python -m bench.bench_cluster [--tokens 64] [--plot-dir bench/plots | --no-plot]

Writes the mid-size random Llama (357.6M params, f32) to a temp folder and streams greedy completions, timing
every token as it arrives. Plots: concurrency.png (aggregate tok/s and p50/p99 inter-token latency vs streams) and
nodes.png (tok/s vs nodes).
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from bench import plots
from bench.random_model import write_random_llama
from shards.progress import Progress, track
from tests.cluster import Cluster

SPLITS = {1: None, 2: ["0:4", "4:8"], 3: ["0:3", "3:6", "6:8"], 4: ["0:2", "2:4", "4:6", "6:8"]}
STREAMS = (1, 2, 4, 8, 16)


def stream_stamps(api_url: str, model: str, prompt: str, tokens: int) -> list[float]:
    """Arrival time of each content chunk of one greedy stream (chunks are tokens here: every id is a word)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"{api_url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    stamps = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"content"' in line and b'"role"' not in line:
                stamps.append(time.perf_counter())
    return stamps


def decode_rate(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def concurrent(api_url: str, model: str, streams: int, tokens: int) -> dict:
    """`streams` streams at once: aggregate tok/s (prefill included) and the inter-token latencies of all."""
    with ThreadPoolExecutor(streams) as pool:
        t = time.perf_counter()
        runs = list(pool.map(lambda i: stream_stamps(api_url, model, f"p{i}", tokens), range(streams)))
        elapsed = time.perf_counter() - t
    gaps = sorted(b - a for stamps in runs for a, b in zip(stamps, stamps[1:]))
    return {"streams": streams, "tok_s": sum(map(len, runs)) / elapsed,
            "p50_ms": 1000 * gaps[len(gaps) // 2], "p99_ms": 1000 * gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))]}


def one_stream(api_url: str, model: str, tokens: int) -> float:
    return statistics.median(decode_rate(stream_stamps(api_url, model, f"prompt {i}", tokens)) for i in range(3))


@contextmanager
def cluster(model: Path, n: int, extra: list[str] | None = None) -> Iterator[str]:
    """n nodes with the layers split evenly, warmed up: yields the entry node's API URL."""
    with Cluster(model, n, shards=SPLITS[n], api_nodes=1, extra=extra) as c:
        stream_stamps(c.nodes[0].api_url, model.name, "warm up", 4)
        yield c.nodes[0].api_url


def sweep(model: Path, tokens: int) -> dict[int, list[dict]]:
    results: dict[int, list[dict]] = {1: [], 3: []}
    with Progress("concurrency sweep", len(results) * sum(STREAMS) * tokens, unit="tokens") as progress:
        for n, rows in results.items():
            with cluster(model, n) as url:
                for streams in STREAMS:
                    rows.append(row := concurrent(url, model.name, streams, tokens))
                    progress.update(streams * tokens)
                    tqdm.write(f"{n} node(s), {streams:2} streams: {row['tok_s']:6.1f} tok/s aggregate (incl. "
                               f"prefill), inter-token p50 {row['p50_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms")
    return results


def by_nodes(model: Path, tokens: int) -> list[dict]:
    results = []
    for n in track([(n, 1) for n in SPLITS], "nodes sweep", unit="clusters"):
        with cluster(model, n) as url:
            row = {"nodes": n, "one": one_stream(url, model.name, tokens),
                   "eight": concurrent(url, model.name, 8, tokens)["tok_s"]}
        results.append(row)
        tqdm.write(f"{n} node(s): {row['one']:.1f} tok/s decode (one stream), {row['eight']:.1f} tok/s aggregate "
                   f"(8 streams)")
    return results


def sampling_ab(model: Path, tokens: int) -> None:
    for label, extra in (("on", None), ("off", ["--sample-batch-max", "1"]), ("on", None)):
        with cluster(model, 3, extra) as url:
            agg = concurrent(url, model.name, 8, tokens)["tok_s"]
        print(f"3 nodes, 8 concurrent streams, sampling batcher {label}: {agg:.1f} tok/s aggregate")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--plot-dir", type=Path, default=plots.PLOTS)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--sampling-ab", action="store_true",
                    help="only compare 8 concurrent streams on 3 nodes with the sampling batcher on vs off")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # progress lines when not on a terminal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the clusters' nodes are stopped too
    if not args.no_plot:
        plots.require()  # before minutes of measuring, not after
    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_llama(Path(tmp) / "mid")
        if args.sampling_ab:
            return sampling_ab(model, args.tokens)
        sweeps = sweep(model, args.tokens)
        nodes = by_nodes(model, args.tokens)
    if not args.no_plot:
        where = f"all nodes on {plots.machine_note()}"
        title = f"random 357.6M Llama (f32), numpy engine, {args.tokens} tokens per stream\n{where}"
        print("wrote", plots.concurrency(sweeps, args.plot_dir / "concurrency.png", title))
        print("wrote", plots.nodes(nodes, args.plot_dir / "nodes.png", f"random 357.6M Llama, numpy engine\n{where}"))


if __name__ == "__main__":
    main()
