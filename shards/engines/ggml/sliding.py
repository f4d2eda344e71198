"""Sliding-window layers (Gemma 2/3) on the ggml engine: a second F16 mask input beside the graph's causal mask, and
the sliding layers' own rotary, given to the shared block through `Step.sliding`.

The graph (shards/engines/ggml/graph.py) builds its step with the causal mask only; `SlidingWindows.builder` wraps
the shard's model for that build, so that the model is called with the same step plus, for every causal mask, an
input of the same shape for the sliding layers. Each run, `fill` derives the window masks from the causal mask the
runner has just filled: a row's visible cells are its own request's positions 0..p in order, ending at its own
cell, so the window keeps the last `size` of them (p-size+1 .. p, as masks.CausalMasks(window=) and transformers
count) and hides the rest. Exact, whatever the cells' layout, and a mask stays an input: one graph serves every
position. A shard whose layers all slide reads no causal mask: its graph holds no such input (ggml allocates only
what the graph reads), so the window masks are written over the causal mask's values instead of into a second
input; a shard without sliding layers needs none of this.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from shards.engines.ggml.backend import GArray, GgmlBackend
from shards.engines.ggml.lib import F16, g
from shards.formats.config import ModelConfig
from shards.model.shard import Shard
from shards.model.transformer import ShardModel, Sliding, Step


class _Build:
    """The shard's model as one graph build sees it: records the window-mask inputs it made for that graph."""

    def __init__(self, model: ShardModel, ops: GgmlBackend, separate: bool):
        self.model, self.ops, self.layers, self.separate = model, ops, model.layers, separate
        self.inputs: list[GArray] = []

    def __call__(self, x, step: Step, caches, last_rows):
        ops = self.ops
        self.inputs = [ops.input(F16, m.shape) for m in step.masks] if self.separate else []
        sliding = Sliding(tuple(self.inputs) or step.masks, ops.sliding_rotary(step.positions))
        return self.model(x, dataclasses.replace(step, sliding=sliding), caches, last_rows)


class SlidingWindows:
    """The sliding-window masks (`size` cells) of a shard with sliding layers, for graphs built through `builder`;
    `separate`: the shard has global layers too, which read the causal masks."""

    def __init__(self, size: int, separate: bool):
        self.size, self.separate = size, separate

    @classmethod
    def for_shard(cls, cfg: ModelConfig, shard: Shard) -> SlidingWindows | None:
        sliding = [cfg.block.sliding_layer(i) for i in range(shard.start_layer, shard.end_layer)]
        return cls(cfg.block.sliding.size, not all(sliding)) if any(sliding) else None

    def builder(self, model: ShardModel, ops: GgmlBackend) -> _Build:
        return _Build(model, ops, self.separate)

    def attach(self, graph, build: _Build) -> None:
        graph.window_masks = build.inputs  # the graph's own inputs: freed with it

    def fill(self, graph, causal: list[np.ndarray]) -> None:
        """Set `graph`'s window masks from its causal masks (F16 0 / -inf, as the runner filled them; in place
        when the shard reads no causal mask)."""
        for i, mask in enumerate(causal):
            window = window_of(mask, self.size)
            if self.separate:
                g.ggml_backend_tensor_set(graph.window_masks[i].t, window.ctypes.data, 0, window.nbytes)
            else:
                mask[...] = window


def window_of(causal: np.ndarray, size: int) -> np.ndarray:
    """[rows, cells] F16: each row's visible cells of `causal` but the last `size`, hidden (-inf)."""
    visible = causal == 0
    cols = np.arange(causal.shape[1])
    last = causal.shape[1] - 1 - np.argmax(visible[:, ::-1], axis=1)  # a row's own cell (rows seeing none: hidden)
    keep = visible & (cols[None, :] > (last - size)[:, None])
    return np.ascontiguousarray(np.where(keep, np.float16(0), np.float16(-np.inf)))
