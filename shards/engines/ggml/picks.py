"""The graph tail that picks greedy tokens on the engine's device (shards/engines/picks.py has the rule).

Per logits row: its argmax (ggml's, whatever its tie-breaking), the value there, and how many values lie strictly
under it, counted as the sum of sign(row - top): -1 under, 0 at the top, 0 for a NaN (ggml's sign of NaN), so a
row with one finite maximum and no NaN sums to -(vocab - 1) exactly (small integers in float32). On a device these
are a few kernels beside the step's; on the CPU they cost more than numpy's pick from the logits in host memory
(ggml's argmax is a scalar loop, its broadcast subtraction an element loop), so a CPU graph has no tail. Two small outputs
come back per step instead of the rows; a row that fails the rule is read from the logits, which stay in the graph's
buffer (an output) for that.
"""

from __future__ import annotations

import numpy as np

from shards.engines.ggml.arrays import GArray, expect
from shards.engines.ggml.lib import Tensor, g
from shards.engines.picks import Pick

EXACT_COUNTS = 1 << 24  # float32 counts every integer up to here exactly


def tail(ops, logits: GArray) -> tuple[Tensor, Tensor]:
    """The ids [rows] (I32) and the stats [rows, 2] (top value, -count under it) of contiguous logits [rows, vocab]."""
    rows, vocab = logits.shape
    expect(vocab < EXACT_COUNTS and logits.strides == (vocab * 4, 4), f"picks over logits {logits.shape}")
    ids = ops.node(g.ggml_argmax, logits.t)
    cells = ops.view(logits, (rows, vocab, 1), (vocab * 4, 4, 4))  # each value a "row" of one, per logits row
    top = ops.node(g.ggml_get_rows, cells.t, ops.node(g.ggml_reshape_2d, ids, 1, rows))
    top = ops.node(g.ggml_reshape_2d, top, 1, rows)
    under = ops.node(g.ggml_sum_rows, ops.node(g.ggml_sgn, ops.node(g.ggml_sub, logits.t, top)))
    return ids, ops.node(g.ggml_concat, top, under, 0)


def read(
    ids_t: Tensor, stats_t: Tensor, logits_t: Tensor, vocab: int, wanted: list[bool], spans: list[tuple[int, int]]
) -> list[Pick]:
    """After the graph ran: a pick per request of `wanted`, over its logits rows [a, b) of `spans` (the tail's rows),
    its rows' logits read where not every one of them was picked."""
    n = max(b for _, b in spans)
    ids, stats = np.empty(n, dtype=np.int32), np.empty((n, 2), dtype=np.float32)
    g.ggml_backend_tensor_get(ids_t, ids.ctypes.data, 0, ids.nbytes)
    g.ggml_backend_tensor_get(stats_t, stats.ctypes.data, 0, stats.nbytes)
    single = np.isfinite(stats[:, 0]) & (stats[:, 1] == -(vocab - 1)) & (ids >= 0) & (ids < vocab)
    out = []
    for w, (a, b) in zip(wanted, spans):
        if w and single[a:b].all():
            out.append(Pick(tokens=tuple(int(t) for t in ids[a:b])))
            continue
        rows = np.empty((b - a, vocab), dtype=np.float32)  # fresh: callers may keep them
        g.ggml_backend_tensor_get(logits_t, rows.ctypes.data, a * vocab * 4, rows.nbytes)
        out.append(Pick(logits=rows))
    return out
