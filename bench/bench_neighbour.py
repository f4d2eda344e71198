"""A busy neighbour: the ggml engine's decode speed alone and beside one process spinning on one core, with the
thread count fixed and adaptive (shards/engines/ggml/threads.py).

    uv run python -m bench.bench_neighbour [--seconds 8] [--rounds 2] [--out bench-neighbour.json]

Each figure comes from a fresh process decoding one stream of the packaged SmolLM2 Q4_1 file on all the cores of
its affinity; the neighbour is `while True: pass` pinned to the last of those cores. Rounds alternate the modes
(the machine may be shared: compare within a round) and record the load average. Goal: beside the
neighbour, at least 0.4x the undisturbed speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def decode(seconds: float, adapt: bool) -> dict:
    """In this process: tok/s of one decode stream (after a 64-token prompt) for `seconds`."""
    import numpy as np

    from shards.engines.base import StepInput
    from shards.engines.ggml.engine import GgmlEngine
    from shards.formats.loader import load_config
    from shards.formats.packaged import resolve_model
    from shards.model.shard import Shard

    path = resolve_model("smollm2")[0]
    cfg = load_config(path)
    engine = GgmlEngine(path, Shard.whole("bench", cfg.n_layers), cfg, adapt_threads=adapt)
    engine.forward([StepInput("a", tokens=np.arange(64) % 1000, max_positions=4096)])
    step = [StepInput("a", tokens=np.array([7]))]
    for _ in range(5):
        engine.forward(step)
    n, threads, t = 0, [], time.perf_counter()
    while time.perf_counter() - t < seconds and n < 3900:
        engine.forward(step)
        threads.append(engine.step_threads)
        n += 1
    rate = n / (time.perf_counter() - t)
    return {"tok_s": rate, "threads": engine.threads, "mean_step_threads": sum(threads) / len(threads)}


def measure(seconds: float, adapt: bool, neighbour: bool) -> dict:
    spinner = None
    if neighbour:
        core = max(os.sched_getaffinity(0))
        spinner = subprocess.Popen(
            [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"]
        )
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.bench_neighbour",
                "--worker",
                str(seconds),
                *(["--fixed"] if not adapt else []),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=seconds + 120,
        )
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result.update(adapt=adapt, neighbour=neighbour, load=os.getloadavg()[0])
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--worker", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--fixed", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(decode(args.worker, adapt=not args.fixed)))
        return
    rows = []
    for r in range(args.rounds):
        for adapt in (False, True):
            for neighbour in (False, True):
                row = measure(args.seconds, adapt, neighbour)
                row["round"] = r
                rows.append(row)
                print(
                    f"round {r} {'adaptive' if adapt else 'fixed   '} threads, "
                    f"{'beside a spinning process' if neighbour else 'alone                    '}: "
                    f"{row['tok_s']:6.1f} tok/s (mean threads {row['mean_step_threads']:.2f}, "
                    f"load {row['load']:.2f})",
                    flush=True,
                )
    print("\n| threads | alone tok/s | beside a spinner tok/s | ratio | load |\n|---|---|---|---|---|")
    for r in range(args.rounds):
        for adapt in (False, True):
            alone, busy = (
                next(x for x in rows if x["round"] == r and x["adapt"] == adapt and x["neighbour"] == n)
                for n in (False, True)
            )
            print(
                f"| {'adaptive' if adapt else 'fixed'} ({alone['threads']}) | {alone['tok_s']:.1f} | "
                f"{busy['tok_s']:.1f} | {busy['tok_s'] / alone['tok_s']:.2f}x | {busy['load']:.1f} |"
            )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
