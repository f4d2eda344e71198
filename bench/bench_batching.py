"""Continuous batching figures: mixed load, long-prompt prefill, tinygrad's first requests.

    uv run python -m bench.bench_batching mixed [--engine numpy]   # 4 streams + a 1500-token prompt, before/after
    uv run python -m bench.bench_batching prefill [--engine numpy] [--lengths 1000,2000,4000,7000]
        [--llama-python /tmp/llamavenv/bin/python]   # llama.cpp on the same file, same lengths, in this run
    uv run python -m bench.bench_batching tinygrad                 # first request at 5 new prompt lengths

All on SmolLM2-135M-Instruct (the packaged GGUF). `mixed`: a node serving 4 greedy streams (200 tokens each) gets a
request with a ~1500-token prompt after their 20th token; it reports the streams' median and longest gap between
tokens, and the long request's time to first token, with whole-prompt prefill ("before": one forward pass for the
whole prompt), with 256-position chunks in a fixed budget, and with the defaults ("after": chunks sized to keep a
step within --max-stall decode steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench.local_cluster import Cluster
from shards.engines.base import StepInput
from shards.engines.registry import engine_class
from shards.formats.loader import load_config
from shards.formats.packaged import resolve_model
from shards.model.shard import Shard

MODEL_ID = "smollm2-135m-instruct"
STORY = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father had "
    "taught him, and watched the ships slide past the rocks on their way to the harbour. "
)
# llama.cpp on the same file, 2 threads, as measured on 2026-11-30: prompt tokens -> seconds to first token (used
# when no --llama-python measures it in the same run)
LLAMA_CPP_TTFT = {1000: 5.9, 2000: 12.1, 4000: 25.8, 7000: 58.7}


def stream(url: str, body: dict, stamps: list[float], started: threading.Event | None = None) -> None:
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=900) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"content"' in line and b'"role"' not in line:
                stamps.append(time.perf_counter())
                if started is not None and len(stamps) == 20:
                    started.set()


def mixed(engine: str, extra: list[str]) -> dict:
    with Cluster(Path("smollm2"), 1, model_id=MODEL_ID, extra=["--engine", engine, *extra]) as c:
        url = c.nodes[0].api_url
        stream(url, {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}, [])
        runs = [[] for _ in range(4)]
        started = threading.Event()
        threads = [
            threading.Thread(
                target=stream,
                args=(
                    url,
                    {
                        "model": MODEL_ID,
                        "messages": [{"role": "user", "content": f"Write a long story about ship {i}."}],
                        "max_tokens": 200,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                    runs[i],
                    started if i == 0 else None,
                ),
            )
            for i in range(4)
        ]
        for t in threads:
            t.start()
        started.wait(300)
        long_prompt = STORY * 50  # ~1500 tokens
        sent, first = time.perf_counter(), []
        stream(url, {"model": MODEL_ID, "messages": [{"role": "user", "content": long_prompt}], "max_tokens": 2}, first)
        for t in threads:
            t.join()
    gaps = [b - a for run in runs for a, b in zip(run, run[1:])]
    return {
        "median_gap_ms": 1000 * statistics.median(gaps),
        "longest_gap_ms": 1000 * max(gaps),
        "ttft_s": first[0] - sent,
        "stream_tokens": [len(r) for r in runs],
    }


def llama_cpp_prefill(python: str, lengths: list[int]) -> dict[int, float]:
    """llama.cpp (bench/llamacpp_ref.py in its own venv) on the same file and lengths, all cores."""
    path, _ = resolve_model("smollm2")
    out = subprocess.run(
        [
            python,
            str(Path(__file__).with_name("llamacpp_ref.py")),
            "prefill",
            str(path),
            "--lengths",
            ",".join(map(str, lengths)),
            "--threads",
            str(os.cpu_count()),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {int(n): s for n, s in json.loads(out.splitlines()[-1])["prefill_s"].items()}


def prefill(engine_name: str, lengths: list[int], chunk: int, reference: dict[int, float]) -> None:
    path, _ = resolve_model("smollm2")
    cfg = load_config(path)
    engine = engine_class(engine_name)(path, Shard.whole(MODEL_ID, cfg.n_layers), cfg)
    rng = np.random.default_rng(0)
    engine.forward([StepInput("warm", tokens=rng.integers(0, 1000, 64))])
    engine.release("warm")
    print(f"{'tokens':>7} {'chunked s':>10} {'tok/s':>7} {'llama.cpp s':>12}")
    for n in lengths:
        tokens = rng.integers(0, cfg.vocab_size, n)
        t = time.perf_counter()
        for piece in np.array_split(tokens, range(chunk, n, chunk)):
            engine.forward([StepInput("p", tokens=piece, max_positions=n)])
        dt = time.perf_counter() - t
        engine.release("p")
        print(f"{n:>7} {dt:>10.1f} {n / dt:>7.0f} {reference.get(n, float('nan')):>12.1f}", flush=True)


def tinygrad_first_requests(lengths: list[int]) -> None:
    """First request at each of `lengths` (all new to the engine), after the same warm-up for both: one request of
    each bucket's largest length. Without buckets every new length compiles new kernels; with them, a length inside
    a bucket that has run before compiles nothing."""
    path, _ = resolve_model("smollm2")
    cfg = load_config(path)
    cls = engine_class("tinygrad")
    for label, buckets in (("before (exact lengths)", None), ("after (buckets 16/64/256)", cls.prefill_buckets)):
        engine = cls(path, Shard.whole(MODEL_ID, cfg.n_layers), cfg)
        engine.prefill_buckets = buckets or ()
        for n in cls.prefill_buckets:  # warm-up, not counted
            engine.forward([StepInput(f"warm{n}", tokens=np.arange(n) % 1000)])
            engine.release(f"warm{n}")
        times = []
        for i, n in enumerate(lengths):
            t = time.perf_counter()
            engine.forward([StepInput(f"r{i}", tokens=np.arange(n) % 1000)])
            times.append(time.perf_counter() - t)
            engine.release(f"r{i}")
        print(
            f"{label:>26}: "
            + "  ".join(f"{n} tok {s:.1f}s" for n, s in zip(lengths, times))
            + f"  | total {sum(times):.1f}s",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["mixed", "prefill", "tinygrad"])
    ap.add_argument("--engine", default="numpy")
    ap.add_argument("--lengths", default="1000,2000,4000,7000")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--llama-python", help="python of a venv with llama-cpp-python: measure llama.cpp in this run")
    args = ap.parse_args()
    if args.what == "mixed":
        for label, extra in (
            (
                "before: whole-prompt prefill",
                ["--prefill-chunk", "8192", "--step-tokens", "8192", "--max-stall", "1e9"],
            ),
            ("chunks of 256, no stall limit", ["--max-stall", "1e9"]),
            ("after: defaults (chunks, stall limit 2)", []),
        ):
            r = mixed(args.engine, extra)
            print(
                f"{label}: streams' median gap {r['median_gap_ms']:.0f} ms, longest {r['longest_gap_ms']:.0f} ms "
                f"({r['longest_gap_ms'] / r['median_gap_ms']:.1f}x); long prompt's first token after "
                f"{r['ttft_s']:.2f} s",
                flush=True,
            )
    elif args.what == "prefill":
        lengths = [int(n) for n in args.lengths.split(",")]
        reference = llama_cpp_prefill(args.llama_python, lengths) if args.llama_python else LLAMA_CPP_TTFT
        prefill(args.engine, lengths, args.chunk, reference)
    else:
        tinygrad_first_requests([23, 41, 57, 95, 170])


if __name__ == "__main__":
    main()
