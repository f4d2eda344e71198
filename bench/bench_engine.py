"""Engine speed on the mid-size random Llama: prefill tok/s, batch-1 and batch-8 decode tok/s, per engine.

    uv run --group bench python -m bench.bench_engine [--model DIR] [--engine numpy,tinygrad,mlx] [--no-plot]
    uv run python -m bench.bench_engine --engine ggml,ggml:q8_0,ggml:q4_0 --no-plot   # ggml, quantized on load

Without --model it writes the random 357.6M-parameter checkpoint to a temp folder first (~1.4 GB). With more than
one engine it draws them side by side in bench/plots/engines.png (--plot-dir to put it elsewhere).
"""

from __future__ import annotations

import argparse
import gc
import logging
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import plots
from bench.random_model import write_random_llama
from shards.engines.base import StepInput
from shards.engines.registry import engine_class
from shards.formats.loader import load_config
from shards.formats.progress import Progress
from shards.model.shard import Shard


def decode_rate(engine, batch: int, steps: int, context: int, progress: Progress) -> float:
    ids = [f"b{batch}-{i}" for i in range(batch)]
    rng = np.random.default_rng(0)
    engine.forward([StepInput(r, tokens=rng.integers(0, 1000, context)) for r in ids])
    tok = [StepInput(r, tokens=np.array([7])) for r in ids]
    for _ in range(3):  # warm-up (tinygrad captures its decode graph on the second call)
        engine.forward(tok)
    t = time.perf_counter()
    for _ in range(steps):
        engine.forward(tok)
        progress.update(1)
    dt = time.perf_counter() - t
    for r in ids:
        engine.release(r)
    return batch * steps / dt


def measure(spec: str, model: Path, steps: int) -> dict[str, float]:
    """spec: an engine name, or ggml:TYPE for the ggml engine quantizing the checkpoint on load."""
    name, _, quantize = spec.partition(":")
    cfg = load_config(model)
    t = time.perf_counter()
    options = {"quantize": quantize} if quantize else {}
    engine = engine_class(name)(model, Shard.whole("bench", cfg.n_layers), cfg, **options)
    name = spec  # the label from here on
    print(f"{name}: load {time.perf_counter() - t:.1f}s, weights {engine.nbytes() / 1e9:.2f} GB")
    # a decode step reads every weight but the embedding table (untied here)
    read_per_token = engine.nbytes() - engine.ops.nbytes(engine.model.embed_tokens)
    results = {}
    with Progress(f"{name}: prefill, decode", 2 + 2 * steps, unit="passes") as progress:
        engine.forward([StepInput("w", tokens=np.arange(256) % 1000)])  # compile/warm up at this shape
        engine.release("w")
        progress.update(1)
        t = time.perf_counter()
        engine.forward([StepInput("p", tokens=np.arange(256) % 1000)])
        results["prefill (256 tokens)"] = 256 / (time.perf_counter() - t)
        engine.release("p")
        progress.update(1)
        for batch in (1, 8):
            results[f"decode, batch {batch}"] = decode_rate(engine, batch, steps, 64, progress)
    print(f"{name}: prefill 256 tokens: {results['prefill (256 tokens)']:.0f} tok/s")
    for batch in (1, 8):
        rate = results[f"decode, batch {batch}"]
        print(
            f"{name}: decode batch {batch}: {rate:.1f} tok/s aggregate ({rate / batch:.1f} steps/s, "
            f"{rate / batch * read_per_token / 1e9:.1f} GB/s of weights)"
        )
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--engine", default="numpy", help="comma-separated: numpy,tinygrad,mlx,ggml,ggml:q8_0,...")
    ap.add_argument("--plot-dir", type=Path, default=plots.PLOTS)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # progress lines when not on a terminal
    if "," in args.engine and not args.no_plot:
        plots.require()  # before minutes of measuring, not after
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_random_llama(Path(tmp) / "mid")
        for name in args.engine.split(","):
            results[name] = measure(name, model, args.steps)
            gc.collect()  # one engine's weights at a time
    if len(results) > 1 and not args.no_plot:
        print(
            "wrote",
            plots.engines(results, args.plot_dir / "engines.png", f"random 357.6M Llama (f32), {plots.machine_note()}"),
        )


if __name__ == "__main__":
    main()
