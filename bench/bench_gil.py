"""How much a second Python thread stretches the ggml engine's decode step: the event loop's work per token (HTTP,
the core, hand-offs) runs beside the engine thread, and while it holds the GIL the engine's own Python between
its ggml calls (inputs, graph lookup, outputs) waits. On a CPU node the step's compute hides this; where the step is
short (a GPU, a small model) it is part of every token.

In process, the test fixture's tiny Llama (a step of well under a millisecond, mostly the engine's Python), decode
steps of one row, with a thread beside them that holds the GIL for --busy microseconds at a time and sleeps
--sleep between (pure Python, as the loop's work is). Each row: the burst length and the mean step.

    uv run python -m bench.bench_gil [--busy 0,100,250] [--sleep 300] [--steps 300]
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np

from shards.engines.base import StepInput
from shards.engines.ggml.engine import GgmlEngine
from shards.formats.loader import load_config
from shards.model.shard import Shard

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gguf" / "llama.gguf"


def mean_step_ms(engine: GgmlEngine, busy_us: int, sleep_us: int, steps: int) -> float:
    stop = threading.Event()

    def neighbour() -> None:
        while not stop.is_set():
            until = time.perf_counter() + busy_us / 1e6
            while time.perf_counter() < until:  # holds the GIL, as the loop's Python does
                pass
            time.sleep(sleep_us / 1e6)

    engine.forward([StepInput("r", tokens=np.array([1, 2, 3, 4]), max_positions=4 + steps + 8)])
    beside = threading.Thread(target=neighbour, daemon=True) if busy_us else None
    if beside:
        beside.start()
    try:
        started = time.perf_counter()
        for _ in range(steps):
            engine.forward([StepInput("r", tokens=np.array([5]), max_positions=4 + steps + 8)])
        return (time.perf_counter() - started) / steps * 1000
    finally:
        stop.set()
        if beside:
            beside.join()
        engine.release("r")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", default="0,100,250", help="microseconds the neighbour holds the GIL at a time")
    ap.add_argument("--sleep", type=int, default=300, help="microseconds it sleeps between")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    cfg = load_config(FIXTURE)
    engine = GgmlEngine(FIXTURE, Shard("m", 0, cfg.n_layers, cfg.n_layers), cfg, threads=1, quantize="none")
    mean_step_ms(engine, 0, args.sleep, 20)  # warm-up: graphs built
    print("| neighbour holds the GIL for | decode step, ms |\n|---|---|")
    for busy in (int(b) for b in args.busy.split(",")):
        print(f"| {busy} us of every {busy + args.sleep} | {mean_step_ms(engine, busy, args.sleep, args.steps):.3f} |")


if __name__ == "__main__":
    main()
