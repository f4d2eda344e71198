"""Causal masks, built one way for every engine: which cached cells each new position may attend to.

A request's step brings `length` positions from `start` on and attends `span` cells of its cache (its positions so
far for an eager engine, a padded capacity for a captured or graph engine). Row p of a mask marks the cells <= p
visible and every cell beyond hidden, whatever the span: padding cells and the cells of later positions stay hidden.
Each engine takes the same masks in its own values: booleans for `where` (numpy, MLX, tinygrad), F16 0 / -inf added
to scores by ggml's flash attention. A sliding-window layer's masks (`window` W) also hide every cell more than W-1
behind the row: row p sees cells p-W+1 .. p, as transformers and llama.cpp count.
"""

from __future__ import annotations

import numpy as np


class CausalMasks:
    """Masks without building them: row p over `span` cells is the slice ramp[h-1-p : h-1-p+span] of one array of h
    `visible` values followed by h `hidden` ones. A single position's mask is such a slice as it is (a view, no
    copy); a chunk's rows are consecutive slices, read out with one strided copy. The ramp grows (doubling) to the
    longest span or position asked for. With a `window` W the ramp is h hidden, W visible, h hidden values: the
    same slices then show each row its last W cells only."""

    def __init__(self, visible, hidden, dtype, window: int | None = None):
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"a sliding window is a positive number of cells, not {window!r}")
        self.visible, self.hidden, self.dtype, self.window = visible, hidden, np.dtype(dtype), window
        self.half = 0
        self.ramp = np.zeros(0, dtype=self.dtype)

    def __call__(self, start: int, length: int, span: int) -> np.ndarray:
        """[length, span]: row i is position start+i's view of cells 0..span-1."""
        if start < 0 or length < 1 or span < 1:
            raise ValueError(f"a mask needs start >= 0, length >= 1 and span >= 1, got {start}, {length}, {span}")
        if max(span, start + length) > self.half:
            self.half = max(span, start + length, 2 * self.half, 1024)
            lead = 0 if self.window is None else self.half
            self.ramp = np.concatenate(
                [
                    np.full(lead, self.hidden, self.dtype),
                    np.full(self.window or self.half, self.visible, self.dtype),
                    np.full(self.half, self.hidden, self.dtype),
                ]
            )
        at = (0 if self.window is None else self.half) + (self.window or self.half) - 1 - start
        if length == 1:
            return self.ramp[at : at + span][None]
        step = self.ramp.itemsize
        rows = np.lib.stride_tricks.as_strided(self.ramp[at - length + 1 :], (length, span), (step, step))[::-1]
        return np.ascontiguousarray(rows)


def allowed(masks: CausalMasks, start: int, length: int, group: int) -> np.ndarray | None:
    """The boolean mask of the eager attention (shards/engines/backend.py): [1, group*T, start+T], rows repeated for
    the `group` query heads sharing a kv head; None for a single position that sees every cached cell (any, but
    past a sliding window)."""
    if length == 1 and (masks.window is None or start < masks.window):
        return None
    return np.tile(masks(start, length, start + length), (group, 1))[None]
