"""The graph tail that picks greedy tokens on the engine's device (shards/engines/picks.py has the rule).

Per logits row: its argmax (ggml's, whatever its tie-breaking), the value there, and how many values lie strictly
under it, counted as the sum of sign(row - top): -1 under, 0 at the top, 0 for a NaN (ggml's sign of NaN), so a
row with one finite maximum and no NaN sums to -(vocab - 1) exactly (small integers in float32). On a device these
are a few kernels beside the step's; on the CPU they cost more than numpy's pick from the logits in host memory
(ggml's argmax is a scalar loop, its broadcast subtraction an element loop), so a CPU graph has no tail. Two small outputs
come back per step instead of the rows; a row that fails the rule is read from the logits, which stay in the graph's
buffer (an output) for that.

A drawn row (shards/engines/picks.py `Draw`) brings back its BEST best ids and values instead (`best_tail`: ggml's
top-k, in no order, and the values there), with what `best_of` checks them by: the lowest of them, how many of the
row's values lie strictly above it (the sum of relu(sgn(row - lowest))), and the row's sum. Only where the device has a
top-k kernel for the row (`has_top_k`): a top-k the scheduler put on the CPU would cost more than the sampler's.
"""

from __future__ import annotations

import numpy as np

from shards.engines.ggml.arrays import GArray, expect
from shards.engines.ggml.lib import F32, Context, Tensor, g
from shards.engines.picks import BEST, Draw, Pick, Want, best_of

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


def best_tail(ops, logits: GArray) -> tuple[Tensor, Tensor, Tensor]:
    """The ids [rows, BEST] (I32, in no order), their values [rows, BEST] and the stats [rows, 3] (the lowest of
    those values, how many of the row's values lie above it, the row's sum) of contiguous logits [rows, vocab]."""
    rows, vocab = logits.shape
    expect(BEST < vocab < EXACT_COUNTS and logits.strides == (vocab * 4, 4), f"candidates of logits {logits.shape}")
    ids = ops.node(g.ggml_top_k, logits.t, BEST)
    cells = ops.view(logits, (rows, vocab, 1), (vocab * 4, 4, 4))
    values = ops.node(g.ggml_get_rows, cells.t, ids)  # [rows, BEST, 1]: the output (a view has no memory of its own)
    lowest = ops.node(g.ggml_argmax, ops.node(g.ggml_neg, ops.node(g.ggml_reshape_2d, values, BEST, rows)))
    low = ops.node(g.ggml_get_rows, values, ops.node(g.ggml_reshape_2d, lowest, 1, rows))
    low = ops.node(g.ggml_reshape_2d, low, 1, rows)
    # relu(sgn(x)), not ggml's step: Vulkan's steps at 0 (x >= 0), the CPU's above it
    above = ops.node(g.ggml_relu, ops.node(g.ggml_sgn, ops.node(g.ggml_sub, logits.t, low)))
    above = ops.node(g.ggml_sum_rows, above)
    total = ops.node(g.ggml_sum_rows, logits.t)
    return ids, values, ops.node(g.ggml_concat, ops.node(g.ggml_concat, low, above, 0), total, 0)


def has_top_k(dev, vocab: int) -> bool:
    """Whether device `dev` runs ggml's top-k of BEST over rows of `vocab` logits itself (asked as llama.cpp asks a
    buffer type: a dummy op, ggml_backend_dev_supports_op)."""
    if not BEST < vocab < EXACT_COUNTS:
        return False
    ctx = Context(2)
    try:
        return bool(g.ggml_backend_dev_supports_op(dev, g.ggml_top_k(ctx.ctx, ctx.new(F32, (vocab, 8)), BEST)))
    finally:
        ctx.free()


def read(
    ids_t: Tensor,
    stats_t: Tensor,
    logits_t: Tensor,
    vocab: int,
    wanted: list[Want],
    spans: list[tuple[int, int]],
    best: tuple[Tensor, ...] = (),
) -> list[Pick]:
    """After the graph ran: a pick per request of `wanted`, over its logits rows [a, b) of `spans` (the tail's rows),
    a drawn row's candidates where the graph has `best_tail`'s outputs and they are taken, its rows' logits read
    where neither was taken."""
    n = max(b for _, b in spans)
    ids, stats = np.empty(n, dtype=np.int32), np.empty((n, 2), dtype=np.float32)
    g.ggml_backend_tensor_get(ids_t, ids.ctypes.data, 0, ids.nbytes)
    g.ggml_backend_tensor_get(stats_t, stats.ctypes.data, 0, stats.nbytes)
    single = np.isfinite(stats[:, 0]) & (stats[:, 1] == -(vocab - 1)) & (ids >= 0) & (ids < vocab)
    drawn = _candidates(best, n) if best and any(isinstance(w, Draw) for w in wanted) else None
    out = []
    for w, (a, b) in zip(wanted, spans):
        if w is True and single[a:b].all():
            out.append(Pick(tokens=tuple(int(t) for t in ids[a:b])))
            continue
        if isinstance(w, Draw) and drawn is not None and b - a == 1:
            c_ids, c_values, c_stats = drawn
            low, above, total = (float(x) for x in c_stats[a])
            if (taken := best_of(c_ids[a], c_values[a], vocab, low, above, total, w)) is not None:
                out.append(Pick(best=taken))
                continue
        rows = np.empty((b - a, vocab), dtype=np.float32)  # fresh: callers may keep them
        g.ggml_backend_tensor_get(logits_t, rows.ctypes.data, a * vocab * 4, rows.nbytes)
        out.append(Pick(logits=rows))
    return out


def _candidates(best: tuple[Tensor, ...], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`best_tail`'s outputs for the tail's first n rows."""
    ids, values, stats = np.empty((n, BEST), np.int32), np.empty((n, BEST), np.float32), np.empty((n, 3), np.float32)
    for t, a in zip(best, (ids, values, stats)):
        g.ggml_backend_tensor_get(t, a.ctypes.data, 0, a.nbytes)
    return ids, values, stats
