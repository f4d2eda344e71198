"""Which weight types CPU_REPACK may hold without costing batch invariance.

CPU_REPACK's interleaved kernels multiply a step's activation rows four at a time with a gemm and the rest one at a
time with a gemv (ggml-cpu/repack.cpp, forward_mul_mat). Where the two sum a dot product in different orders, a row's
numbers depend on how many rows share its step: a replay that prefills generated tokens, or a request decoded beside
others, would no longer repeat its tokens. The kernels differ by type and by CPU (on an AVX-512 EPYC, Q4_K's do and
Q4_0's don't), so each type is probed once per process on the CPU it runs on: a row multiplied alone, then as the
first (gemm) and the last (gemv) of five rows, must give the same bits. A type that fails stays in plain memory,
where one kernel serves every row count.
"""

from __future__ import annotations

import numpy as np

from shards.engines.ggml.host_memory import WeightArena
from shards.engines.ggml.lib import F32, Context, compute_once, g, quantize, repack_supported

PROBE_IN, PROBE_OUT = 512, 64  # a weight [64, 512]: whole blocks of every type, whole interleave groups
_verdicts: dict[int, bool] = {}


def repack_keeps_rows(ggml_type: int) -> bool:
    """CPU_REPACK takes this type here, and its kernels give a row the same bits alone and among others."""
    if ggml_type not in _verdicts:
        _verdicts[ggml_type] = repack_supported(ggml_type, (PROBE_IN, PROBE_OUT)) and _probe(ggml_type)
    return _verdicts[ggml_type]


def _probe(ggml_type: int) -> bool:
    rng = np.random.default_rng(0)
    weight = quantize(rng.standard_normal((PROBE_OUT, PROBE_IN), dtype=np.float32), ggml_type)
    row, others = rng.standard_normal((1, PROBE_IN), dtype=np.float32), rng.standard_normal((3, PROBE_IN), np.float32)
    batch = np.concatenate([row, others, row])  # row 0 goes through the gemm, row 4 through the gemv
    ctx, arena = Context(8, graph=True), WeightArena()
    try:
        w = ctx.new(ggml_type, (PROBE_IN, PROBE_OUT))
        arena.place_repacked(w, weight)
        x1, x5 = ctx.new(F32, (PROBE_IN, 1)), ctx.new(F32, (PROBE_IN, 5))
        ctx.room(2)
        y1, y5 = g.ggml_mul_mat(ctx.ctx, w, x1), g.ggml_mul_mat(ctx.ctx, w, x5)
        alone, together = compute_once(
            ctx, [(y1, (1, PROBE_OUT)), (y5, (5, PROBE_OUT))], [(x1, row), (x5, batch)], "the repack probe"
        )
        return np.array_equal(alone[0], together[0]) and np.array_equal(alone[0], together[4])
    finally:
        arena.free()
        ctx.free()
