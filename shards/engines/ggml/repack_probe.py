"""Which weight types CPU_REPACK may hold without costing batch invariance, and how.

CPU_REPACK's interleaved kernels multiply a step's activation rows four at a time with a gemm and the rest one at a
time with a gemv (ggml-cpu/repack.cpp, forward_mul_mat). Where the two sum a dot product in different orders, a row's
numbers depend on how many rows share its step: a replay that prefills generated tokens, or a request decoded beside
others, would no longer repeat its tokens. The kernels differ by type and by CPU (on an AVX-512 EPYC, Q4_K's agree
and Q4_0's don't; on an AVX-512 Intel Xeon, Q4_K's don't), so each type is probed once per process on the CPU it
runs on:
- `repack_keeps_rows`: a row multiplied alone, then as the first (gemm) and the last (gemv) of five rows, gives the
  same bits: the type is repacked and multiplied as ggml chooses;
- `repack_pads_rows` (asked where the first fails): a row padded with zero rows to PAD_ROWS, and the same row
  among others at several places of steps of 8 and 12 rows, gives the same bits, so the gemm alone keeps a row's
  numbers: the type is repacked and every matmul on it takes its rows in multiples of PAD_ROWS (its padding's
  outputs dropped), which never reach the gemv. Where the gemm is faster than the plain kernel even for one row
  (the repacked layout streams better: docs/benchmarks.md, "A 7B-shaped Q4_K_M") this is faster at every count.
A type that fails both stays in plain memory, where one kernel serves every row count.
"""

from __future__ import annotations

import numpy as np

from shards.engines.ggml.host_memory import WeightArena
from shards.engines.ggml.lib import F32, Context, compute_once, g, quantize, repack_supported

PROBE_IN, PROBE_OUT = 512, 64  # a weight [64, 512]: whole blocks of every type, whole interleave groups
PAD_ROWS = 4  # the rows CPU_REPACK's gemm takes at once: a step of a multiple of this never reaches its gemv
_verdicts: dict[tuple[int, str], bool] = {}


def repack_keeps_rows(ggml_type: int) -> bool:
    """CPU_REPACK takes this type here, and its kernels give a row the same bits alone and among others."""
    key = (ggml_type, "rows")
    if key not in _verdicts:
        _verdicts[key] = repack_supported(ggml_type, (PROBE_IN, PROBE_OUT)) and _probe(ggml_type)
    return _verdicts[key]


def repack_pads_rows(ggml_type: int) -> bool:
    """CPU_REPACK takes this type here, and its gemm gives a row the same bits padded alone and among others."""
    key = (ggml_type, "padded")
    if key not in _verdicts:
        _verdicts[key] = repack_supported(ggml_type, (PROBE_IN, PROBE_OUT)) and _probe_padded(ggml_type)
    return _verdicts[key]


def _probe(ggml_type: int) -> bool:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((PROBE_OUT, PROBE_IN), dtype=np.float32)
    row, others = rng.standard_normal((1, PROBE_IN), dtype=np.float32), rng.standard_normal((3, PROBE_IN), np.float32)
    batch = np.concatenate([row, others, row])  # row 0 goes through the gemm, row 4 through the gemv
    alone, together = _products(ggml_type, weight, [row, batch])
    return np.array_equal(alone[0], together[0]) and np.array_equal(alone[0], together[4])


def _probe_padded(ggml_type: int) -> bool:
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((PROBE_OUT, PROBE_IN), dtype=np.float32)
    row, others = rng.standard_normal((1, PROBE_IN), dtype=np.float32), rng.standard_normal((11, PROBE_IN), np.float32)
    padded = np.concatenate([row, np.zeros((PAD_ROWS - 1, PROBE_IN), np.float32)])
    eight = np.concatenate([row, others[:6], row])  # first and last of two groups
    twelve = np.concatenate([others[:5], row, others[5:11]])  # inside the second of three
    alone, *batches = _products(ggml_type, weight, [padded, eight, twelve])
    return all(np.array_equal(alone[0], y) for y in (batches[0][0], batches[0][7], batches[1][5]))


def _products(ggml_type: int, values: np.ndarray, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Each of `inputs` [n, PROBE_IN] times `values` [PROBE_OUT, PROBE_IN] as `ggml_type`, held in CPU_REPACK."""
    weight = quantize(values, ggml_type)
    ctx, arena = Context(1 + 2 * len(inputs), graph=True), WeightArena()
    try:
        w = ctx.new(ggml_type, (PROBE_IN, PROBE_OUT))
        arena.place_repacked(w, weight)
        xs = [ctx.new(F32, (PROBE_IN, len(x))) for x in inputs]
        ctx.room(len(xs))
        ys = [(g.ggml_mul_mat(ctx.ctx, w, x), (len(a), PROBE_OUT)) for x, a in zip(xs, inputs)]
        return compute_once(ctx, ys, list(zip(xs, inputs)), "the repack probe")
    finally:
        arena.free()
        ctx.free()
