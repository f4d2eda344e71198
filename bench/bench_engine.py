"""Engine speed on the mid-size random Llama: prefill tok/s, batch-1 and batch-8 decode tok/s.

    uv run python -m bench.bench_engine [--model DIR] [--engine numpy|tinygrad|mlx]

Without --model it writes the random 357.6M-parameter checkpoint to a temp folder first (~1.4 GB).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.random_model import write_random_llama
from shards.config import ModelConfig
from shards.engine import StepInput
from shards.engines import engine_class
from shards.shard import Shard


def decode_rate(engine, batch: int, steps: int, context: int) -> float:
    ids = [f"b{batch}-{i}" for i in range(batch)]
    rng = np.random.default_rng(0)
    engine.forward([StepInput(r, tokens=rng.integers(0, 1000, context)) for r in ids])
    tok = [StepInput(r, tokens=np.array([7])) for r in ids]
    for _ in range(3):  # warm-up (tinygrad captures its decode graph on the second call)
        engine.forward(tok)
    t = time.perf_counter()
    for _ in range(steps):
        engine.forward(tok)
    dt = time.perf_counter() - t
    for r in ids:
        engine.release(r)
    return batch * steps / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--engine", default="numpy")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_random_llama(Path(tmp) / "mid")
        cfg = ModelConfig.from_dir(model)
        t = time.perf_counter()
        engine = engine_class(args.engine)(model, Shard.whole("bench", cfg.n_layers), cfg)
        print(f"load: {time.perf_counter() - t:.1f}s, weights {engine.nbytes() / 1e9:.2f} GB")
    embed = cfg.vocab_size * cfg.hidden_size * 4
    read_per_token = engine.nbytes() - embed  # a decode step reads every matrix but the embedding
    t = time.perf_counter()
    engine.forward([StepInput("w", tokens=np.arange(256) % 1000)])  # compile/warm up at this shape
    engine.release("w")
    t = time.perf_counter()
    engine.forward([StepInput("p", tokens=np.arange(256) % 1000)])
    print(f"prefill 256 tokens: {256 / (time.perf_counter() - t):.0f} tok/s")
    engine.release("p")
    for batch in (1, 8):
        rate = decode_rate(engine, batch, args.steps, context=64)
        per_step = rate / batch
        print(f"decode batch {batch}: {rate:.1f} tok/s aggregate ({per_step:.1f} steps/s, "
              f"{per_step * read_per_token / 1e9:.1f} GB/s of weights)")


if __name__ == "__main__":
    main()
