"""Decode speed through the HTTP API: a concurrency sweep on one node and on a 3-node loopback pipeline, and the
speed of one stream as the layers are split over 1-4 nodes.

    uv run --group bench python -m bench.bench_cluster [--tokens 64] [--plot-dir bench/plots | --no-plot]
        [--model random357m | smollm2 | PATH] [--engine numpy | ggml | ...] [--node-args "--threads 1"]

By default writes the mid-size random Llama (357.6M params, f32) to a temp folder; streams greedy completions,
timing every token as it arrives. Plots: concurrency.png (aggregate tok/s and p50/p99 inter-token latency vs streams) and
nodes.png (tok/s vs nodes).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shlex
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from bench import plots
from bench.local_cluster import Cluster
from bench.random_model import write_random_llama
from shards.formats.loader import load_config
from shards.formats.packaged import resolve_model
from shards.formats.progress import Progress, track

NODES = (1, 2, 3, 4)
STREAMS = (1, 2, 4, 8, 16)


def stream_stamps(api_url: str, model: str, prompt: str, tokens: int) -> tuple[list[float], int]:
    """Arrival time of each content chunk of one greedy stream, and its tokens (the usage: a chunk carries every
    token that came while the one before was written)."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    req = urllib.request.Request(
        f"{api_url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    stamps, used = [], 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"usage"' in line:
                used = json.loads(line[6:])["usage"]["completion_tokens"]
            elif line.startswith(b"data: {") and b'"content"' in line and b'"role"' not in line:
                stamps.append(time.perf_counter())
    return stamps, used or len(stamps)  # a server without usage: its chunks


def decode_rate(run: tuple[list[float], int]) -> float:
    stamps, used = run
    return (used - 1) / (stamps[-1] - stamps[0])


def concurrent(api_url: str, model: str, streams: int, tokens: int) -> dict:
    """`streams` streams at once: aggregate tok/s (prefill included) and the gaps between the chunks of all."""
    with ThreadPoolExecutor(streams) as pool:
        t = time.perf_counter()
        runs = list(pool.map(lambda i: stream_stamps(api_url, model, f"p{i}", tokens), range(streams)))
        elapsed = time.perf_counter() - t
    gaps = sorted(b - a for stamps, _ in runs for a, b in zip(stamps, stamps[1:]))
    return {
        "streams": streams,
        "tok_s": sum(used for _, used in runs) / elapsed,
        "p50_ms": 1000 * gaps[len(gaps) // 2],
        "p99_ms": 1000 * gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))],
    }


def one_stream(api_url: str, model: str, tokens: int) -> float:
    return statistics.median(decode_rate(stream_stamps(api_url, model, f"prompt {i}", tokens)) for i in range(3))


@dataclass(frozen=True)
class Setup:
    """What every cluster of a run serves and how its nodes are started."""

    model: Path
    model_id: str
    engine: str = "numpy"
    node_args: tuple[str, ...] = ()

    def splits(self, n: int) -> list[str] | None:
        layers = load_config(self.model).n_layers
        cuts = [round(i * layers / n) for i in range(n + 1)]
        return [f"{a}:{b}" for a, b in zip(cuts, cuts[1:])] if n > 1 else None


@contextmanager
def cluster(setup: Setup, n: int, extra: list[str] | None = None) -> Iterator[str]:
    """n nodes with the layers split evenly, warmed up: yields the entry node's API URL."""
    with Cluster(
        setup.model,
        n,
        shards=setup.splits(n),
        api_nodes=1,
        model_id=setup.model_id,
        engine=setup.engine,
        extra=[*setup.node_args, *(extra or [])],
    ) as c:
        stream_stamps(c.nodes[0].api_url, setup.model_id, "warm up", 4)
        yield c.nodes[0].api_url


def sweep(setup: Setup, tokens: int) -> dict[int, list[dict]]:
    results: dict[int, list[dict]] = {1: [], 3: []}
    with Progress("concurrency sweep", len(results) * sum(STREAMS) * tokens, unit="tokens") as progress:
        for n, rows in results.items():
            with cluster(setup, n) as url:
                for streams in STREAMS:
                    rows.append(row := concurrent(url, setup.model_id, streams, tokens))
                    progress.update(streams * tokens)
                    tqdm.write(
                        f"{n} node(s), {streams:2} streams: {row['tok_s']:6.1f} tok/s aggregate (incl. "
                        f"prefill), inter-token p50 {row['p50_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms"
                    )
    return results


def by_nodes(setup: Setup, tokens: int) -> list[dict]:
    results = []
    for n in track([(n, 1) for n in NODES], "nodes sweep", unit="clusters"):
        with cluster(setup, n) as url:
            row = {
                "nodes": n,
                "one": one_stream(url, setup.model_id, tokens),
                "eight": concurrent(url, setup.model_id, 8, tokens)["tok_s"],
            }
        results.append(row)
        tqdm.write(
            f"{n} node(s): {row['one']:.1f} tok/s decode (one stream), {row['eight']:.1f} tok/s aggregate (8 streams)"
        )
    return results


def sampling_ab(setup: Setup, tokens: int) -> None:
    for label, extra in (("on", None), ("off", ["--sample-batch-max", "1"]), ("on", None)):
        with cluster(setup, 3, extra) as url:
            agg = concurrent(url, setup.model_id, 8, tokens)["tok_s"]
        print(f"3 nodes, 8 concurrent streams, sampling batcher {label}: {agg:.1f} tok/s aggregate")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--plot-dir", type=Path, default=plots.PLOTS)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--model",
        default="random357m",
        help="random357m (written to a temp folder), a packaged model's name, or a model path",
    )
    ap.add_argument("--engine", default="numpy")
    ap.add_argument("--node-args", default="", help='more arguments for every node, e.g. "--threads 1"')
    ap.add_argument(
        "--sampling-ab",
        action="store_true",
        help="only compare 8 concurrent streams on 3 nodes with the sampling batcher on vs off",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # progress lines when not on a terminal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the clusters' nodes are stopped too
    if not args.no_plot:
        plots.require()  # before minutes of measuring, not after
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "random357m":
            model, model_id, label = write_random_llama(Path(tmp) / "mid"), "mid", "random 357.6M Llama (f32)"
        else:
            model, model_id = resolve_model(args.model)
            label = model_id
        setup = Setup(model, model_id, args.engine, tuple(shlex.split(args.node_args)))
        if args.sampling_ab:
            return sampling_ab(setup, args.tokens)
        sweeps = sweep(setup, args.tokens)
        nodes = by_nodes(setup, args.tokens)
    print(json.dumps({"sweep": sweeps, "nodes": nodes}))
    if not args.no_plot:
        where = f"all nodes on {plots.machine_note()}"
        what = f"{label}, {args.engine} engine {args.node_args}".rstrip()
        suffix = (
            ""
            if (args.model, args.engine, args.node_args) == ("random357m", "numpy", "")
            else "-".join(["", model_id, args.engine, *(re.sub(r"\W+", "", a) for a in shlex.split(args.node_args))])
        )
        print(
            "wrote",
            plots.concurrency(
                sweeps, args.plot_dir / f"concurrency{suffix}.png", f"{what}, {args.tokens} tokens per stream\n{where}"
            ),
        )
        print("wrote", plots.nodes(nodes, args.plot_dir / f"nodes{suffix}.png", f"{what}\n{where}"))


if __name__ == "__main__":
    main()
