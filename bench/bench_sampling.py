"""Sampling cost per token with 8 concurrent requests: one batched call vs one call per request.

    uv run python -m bench.bench_sampling

Measures the numpy sampler directly (sample_rows on [8, vocab] vs 8 x sample_one) and through the
SamplingBatcher (batching on vs --sample-batch-max 1), for vocab sizes 32k and 152k; for a top-k row (or a greedy
or top-k row with penalties that only lower logits), also the host's part of a draw from the row's 128 best logits
a GPU node's graph hands back instead of the row: `best_of`'s checks (and the bias and penalties applied to the
candidates) and `sample_best` (shards/engines/picks.py), the device's part (its top-k, the lowest and the count
above it) made once beforehand.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from node.runtime.sampling_batcher import SampleItem, SamplingBatcher
from shards.decoding.sampling import SamplerState, SamplingParams, sample_best, sample_one, sample_rows
from shards.engines.numpy_engine import NumpyEngine
from shards.engines.picks import BEST, Draw, best_of
from shards.model.shard import Shard

N = 8
CONTEXT = tuple(range(100, 164))
KINDS = {
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "temp0.8,top_p0.95": lambda i: SamplingParams(temperature=0.8, top_p=0.95, seed=i),
    "temp0.7,top_k40": lambda i: SamplingParams(temperature=0.7, top_k=40, seed=i),
    "ollama": lambda i: SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=i),
    # with llama-server's repeat_penalty over a 64-token window the prompt's tail starts
    "ollama,repeat1.1": lambda i: SamplingParams(
        temperature=0.8, top_k=40, top_p=0.9, seed=i, repetition_penalty=1.1, penalty_context=CONTEXT
    ),
    "greedy,repeat1.1": lambda i: SamplingParams(temperature=0.0, repetition_penalty=1.1, penalty_context=CONTEXT),
}


def _engine() -> NumpyEngine:
    """A real engine for its samplers (which only look at the logits they are given)."""
    d = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llama"
    return NumpyEngine(d, Shard("llama", 5, 6, 6))


def per_token_us(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps / N * 1e6


async def through_batcher(logits, params, max_batch: int, reps: int) -> float:
    engine, batcher = _engine(), SamplingBatcher(max_batch, 5.0)
    states = [SamplerState.from_seed(i) for i in range(N)]

    async def step():
        futures = [batcher.submit(SampleItem(f"r{i}", logits[i], params[i], states[i], engine, "m")) for i in range(N)]
        batcher.flush()
        await asyncio.gather(*futures)

    await step()
    t = time.perf_counter()
    for _ in range(reps):
        await step()
    await batcher.close()
    return (time.perf_counter() - t) / reps / N * 1e6


def device_claim(row: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, float]:
    """The row's 128 best (in no order), their values, the lowest and the count above it: what a GPU node's graph
    tail hands back (shards/engines/ggml/picks.py `best_tail`)."""
    ids = np.argpartition(row, len(row) - BEST)[len(row) - BEST :]
    low = float(row[ids].min())
    return ids, row[ids], low, float(np.count_nonzero(row > low))


def main() -> None:
    print(
        f"{'vocab':>7} {'params':>18} | {'batched':>9} {'per-req':>9} | {'batcher on':>10} {'batcher off':>11} |"
        f" {'from best':>9}  (us/token)"
    )
    for vocab in (32_000, 152_064):
        logits = np.random.default_rng(0).normal(0, 3, size=(N, vocab)).astype(np.float32)
        for kind, make in KINDS.items():
            params = [make(i) for i in range(N)]
            states = [SamplerState.from_seed(i) for i in range(N)]
            reps = 30
            batched = per_token_us(lambda: sample_rows(logits, params, states), reps)
            single = per_token_us(lambda: [sample_one(logits[i], params[i], states[i]) for i in range(N)], reps)
            on = asyncio.run(through_batcher(logits, params, 8, reps))
            off = asyncio.run(through_batcher(logits, params, 1, reps))
            drawn = "-"
            if all(Draw.of(p) for p in params):  # the host's part: the candidates checked (and lowered), drawn
                claims = [device_claim(row) for row in logits]

                def from_best():
                    for (top, values, low, above), p, s in zip(claims, params, states):
                        draw = Draw.of(p, tuple(s.window(p)) if p.penalized else ())
                        best = best_of(top, values, vocab, low, above, 0.0, draw)
                        sample_best(best.ids, best.values, p, s)

                drawn = f"{per_token_us(from_best, reps):.0f}"
            print(f"{vocab:>7} {kind:>18} | {batched:9.0f} {single:9.0f} | {on:10.0f} {off:11.0f} | {drawn:>9}")


if __name__ == "__main__":
    main()
