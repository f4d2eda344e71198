"""What keeping float-weight matmuls batch-invariant costs (`--float-matmul`, shards/engines/ggml/gemm_rows.py).

The packaged SmolLM2 as a node runs it by default (requantized to F16) on the ggml engine, once per mode: `fast`
(ggml's own kernel choice per step: not batch-invariant), `pad` (the default) and `rowwise`. Each round measures
every mode in turn, to spread the machine's load over them: decode steps at batch 1 and 8 (64-token contexts) and a
256-token prefill. Printed: the median over rounds of the CPU time per step (this process's, so other processes on
a busy machine weigh less than on wall time; with 1 thread ggml computes on the calling thread) and of the wall
time, each mode's ratio to `fast`, and the load average.

Then one F16 weight alone, by 1 row (ggml's vec_dot: `fast` and `rowwise` for a lone row) and by 2 (tinyBLAS: `pad`'s
lone row, padded): a feed-forward projection held in the caches, and the head (vocabulary x hidden: 57 MB for
SmolLM2, more than most CPUs' caches) streamed from memory, as every weight of a decode step is. Where the two kernels cost the same in cache but
not from memory, `pad`'s price at one stream is how tinyBLAS streams a weight (four rows at a time), not its math.

    .venv/bin/python -m bench.bench_float_rows [--rounds 3] [--steps 16] [--threads 1] [--quantize f16]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import numpy as np

from shards.engines.base import StepInput
from shards.engines.ggml.engine import GgmlEngine
from shards.engines.ggml.lib import F16, F32, g
from shards.engines.registry import FLOAT_MATMUL_CHOICES
from shards.formats.loader import load_config
from shards.formats.packaged import DEFAULT_MODEL, default_quantize, resolve_model
from shards.model.shard import Shard

BASE = "fast"


def timed(fn) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of fn()."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def decode(engine: GgmlEngine, batch: int, steps: int, tag: str) -> tuple[float, float]:
    """Per decode step: `batch` requests of 64 cached positions, one token each."""
    rng = np.random.default_rng(0)
    ids = [f"{tag}-{i}" for i in range(batch)]
    engine.forward([StepInput(r, tokens=rng.integers(0, 1000, 64)) for r in ids])
    step = [StepInput(r, tokens=np.array([7])) for r in ids]
    engine.forward(step)  # this shape's graph, built outside the timing
    cpu, wall = timed(lambda: [engine.forward(step) for _ in range(steps)])
    for r in ids:
        engine.release(r)
    return cpu / steps, wall / steps


def prefill(engine: GgmlEngine, tag: str, n: int = 256) -> tuple[float, float]:
    tokens = np.arange(n) % 1000
    engine.forward([StepInput(f"{tag}-warm", tokens=tokens)])  # the graph, built outside the timing
    engine.release(f"{tag}-warm")
    out = timed(lambda: engine.forward([StepInput(tag, tokens=tokens)]))
    engine.release(tag)
    return out


def weight_alone(out: int, k: int, rows: int, threads: int, reps: int) -> float:
    """Wall seconds for one product of a random F16 weight [out, k] by `rows` float32 rows on `threads` (the median of
    `reps`, after one to warm up)."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((out, k)) * 0.05).astype(np.float16)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    ctx = g.ggml_init(
        g.ggml_init_params(
            mem_size=w.nbytes + 8 * x.nbytes + 4 * rows * out + (16 << 20), mem_buffer=None, no_alloc=False
        )
    )
    try:
        wt, xt = g.ggml_new_tensor_2d(ctx, F16, k, out), g.ggml_new_tensor_2d(ctx, F32, k, rows)
        ctypes.memmove(wt.contents.data, w.ctypes.data, w.nbytes)
        ctypes.memmove(xt.contents.data, x.ctypes.data, x.nbytes)
        graph = g.ggml_new_graph(ctx)
        g.ggml_build_forward_expand(graph, g.ggml_mul_mat(ctx, wt, xt))
        times = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            g.ggml_graph_compute_with_ctx(ctx, graph, threads)
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])
    finally:
        g.ggml_free(ctx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quantize", default=None, help="default: the packaged model's own (f16)")
    args = ap.parse_args()
    path, model_id = resolve_model(DEFAULT_MODEL)
    quantize = args.quantize or default_quantize(model_id, "ggml", None)
    cfg = load_config(path)
    shard = Shard.whole("bench", cfg.n_layers)
    engines = {
        mode: GgmlEngine(
            path, shard, cfg, threads=args.threads, quantize=quantize, adapt_threads=False, float_matmul=mode
        )
        for mode in FLOAT_MATMUL_CHOICES
    }
    cases = {
        "decode, batch 1": lambda e, tag: decode(e, 1, args.steps, tag),
        "decode, batch 8": lambda e, tag: decode(e, 8, args.steps, tag),
        "prefill 256": lambda e, tag: prefill(e, tag),
    }
    results = {(mode, case): [] for mode in engines for case in cases}
    loads = []
    for r in range(args.rounds):
        for case, run in cases.items():
            for mode, engine in engines.items():
                results[mode, case].append(run(engine, f"r{r}"))
        loads.append(os.getloadavg()[0])
    print(
        f"SmolLM2 {quantize} on ggml, {args.threads} thread(s), median of {args.rounds} rounds; "
        f"load average {min(loads):.1f}-{max(loads):.1f} (1 min)"
    )
    for case in cases:
        base = [statistics.median(x[i] for x in results[BASE, case]) for i in (0, 1)]
        cells = []
        for mode in engines:
            cpu, wall = (statistics.median(x[i] for x in results[mode, case]) for i in (0, 1))
            cells.append(f"{mode} {cpu * 1e3:7.1f} ms CPU ({cpu / base[0]:.2f}x) {wall * 1e3:7.1f} ms wall")
        print(f"  {case:16} " + " | ".join(cells))
    for name, (out, k), reps in (
        ("a projection, in cache", (cfg.intermediate_size, cfg.hidden_size), 200),
        ("the head, from memory", (cfg.vocab_size, cfg.hidden_size), 20),
    ):
        one, two = (weight_alone(out, k, n, args.threads, reps) for n in (1, 2))
        gb = out * k * 2 / 1e9
        print(
            f"  F16 {out} x {k} ({name}): 1 row {one * 1e6:8.1f} us ({gb / one:5.1f} GB/s) | 2 rows {two * 1e6:8.1f} us "
            f"({gb / two:5.1f} GB/s): {two / one:.2f}x"
        )


if __name__ == "__main__":
    main()
