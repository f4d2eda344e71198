"""Causal masks, built one way for every engine: which cached cells each new position may attend to.

A request's step brings `length` positions from `start` on and attends `span` cells of its cache (its positions so
far for an eager engine, a padded capacity for a captured or graph engine). Row p of a mask marks the cells <= p
visible and every cell beyond hidden, whatever the span: padding cells and the cells of later positions stay hidden.
Each engine takes the same masks in its own values: booleans for `where` (numpy, MLX, tinygrad), F16 0 / -inf added
to scores by ggml's flash attention.
"""

from __future__ import annotations

import numpy as np


class CausalMasks:
    """Masks without building them: row p over `span` cells is the slice ramp[h-1-p : h-1-p+span] of one array of h
    `visible` values followed by h `hidden` ones. A single position's mask is such a slice as it is (a view, no
    copy); a chunk's rows are consecutive slices, read out with one strided copy. The ramp grows (doubling) to the
    longest span or position asked for."""

    def __init__(self, visible, hidden, dtype):
        self.visible, self.hidden, self.dtype = visible, hidden, np.dtype(dtype)
        self.half = 0
        self.ramp = np.zeros(0, dtype=self.dtype)

    def __call__(self, start: int, length: int, span: int) -> np.ndarray:
        """[length, span]: row i is position start+i's view of cells 0..span-1."""
        if start < 0 or length < 1 or span < 1:
            raise ValueError(f"a mask needs start >= 0, length >= 1 and span >= 1, got {start}, {length}, {span}")
        if max(span, start + length) > self.half:
            self.half = max(span, start + length, 2 * self.half, 1024)
            self.ramp = np.concatenate(
                [np.full(self.half, self.visible, self.dtype), np.full(self.half, self.hidden, self.dtype)]
            )
        at = self.half - 1 - start
        if length == 1:
            return self.ramp[at : at + span][None]
        step = self.ramp.itemsize
        rows = np.lib.stride_tricks.as_strided(self.ramp[at - length + 1 :], (length, span), (step, step))[::-1]
        return np.ascontiguousarray(rows)


def allowed(masks: CausalMasks, start: int, length: int, group: int) -> np.ndarray | None:
    """The boolean mask of the eager attention (shards/engines/backend.py): [1, group*T, start+T], rows repeated for
    the `group` query heads sharing a kv head; None for a single position, which sees every cached cell."""
    if length == 1:
        return None
    return np.tile(masks(start, length, start + length), (group, 1))[None]
