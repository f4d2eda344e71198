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
from shards.engines.ggml.lib import (
    F32,
    Context,
    GgmlError,
    cpu_buffer_type,
    g,
    quantize,
    repack_supported,
)

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
    ctx, arena, galloc, backend = Context(8, graph=True), WeightArena(), None, None
    try:
        w = ctx.new(ggml_type, (PROBE_IN, PROBE_OUT))
        arena.place_repacked(w, weight)
        x1, x5 = ctx.new(F32, (PROBE_IN, 1)), ctx.new(F32, (PROBE_IN, 5))
        for x in (x1, x5):
            g.ggml_set_input(x)
        ctx.room(2)
        y1, y5 = g.ggml_mul_mat(ctx.ctx, w, x1), g.ggml_mul_mat(ctx.ctx, w, x5)
        gf = ctx.graph()
        for y in (y1, y5):
            g.ggml_set_output(y)
            g.ggml_build_forward_expand(gf, y)
        galloc = g.ggml_gallocr_new(cpu_buffer_type())
        if not galloc or not g.ggml_gallocr_alloc_graph(galloc, gf):
            raise MemoryError("ggml could not allocate the repack probe's graph")
        g.ggml_backend_tensor_set(x1, row.ctypes.data, 0, row.nbytes)
        g.ggml_backend_tensor_set(x5, batch.ctypes.data, 0, batch.nbytes)
        backend = g.ggml_backend_cpu_init()
        g.ggml_backend_cpu_set_n_threads(backend, 2)
        if g.ggml_backend_graph_compute(backend, gf) != 0:
            raise GgmlError("the repack probe's graph failed to compute")
        alone, together = np.empty((1, PROBE_OUT), np.float32), np.empty((5, PROBE_OUT), np.float32)
        g.ggml_backend_tensor_get(y1, alone.ctypes.data, 0, alone.nbytes)
        g.ggml_backend_tensor_get(y5, together.ctypes.data, 0, together.nbytes)
        return np.array_equal(alone[0], together[0]) and np.array_equal(alone[0], together[4])
    finally:
        if backend:
            g.ggml_backend_free(backend)
        if galloc:
            g.ggml_gallocr_free(galloc)
        arena.free()
        ctx.free()
