"""How a step is carried out once `Engine.run` has validated and packed it: the pluggable part of an engine.

A `Runner` makes and grows each request's cache (it knows the storage) and computes a packed step over the shared
model: `EagerRunner` op by op (numpy, MLX, and tinygrad's shapes it has not captured), tinygrad's `TinyJitRunner`
by replaying captured kernels, ggml's `GraphRunner` by re-running a graph built once per batch layout. A runner
writes keys and values but never advances a cache's length: `Engine.run` commits the step once it returns.
Masks come from shards/engines/masks.py in every runner, in its backend's form.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import numpy as np

from shards.engines.backend import EagerBackend, RequestCache
from shards.engines.masks import CausalMasks, allowed
from shards.engines.step import Packing, StepInput
from shards.formats.config import ModelConfig
from shards.model.shard import Shard
from shards.model.transformer import ShardModel, Sliding, Step


class EngineParts(Protocol):
    """What a runner reads of its engine (an `Engine`), named here so that runners never import the engine
    module that imports them."""

    ops: EagerBackend
    model: ShardModel
    config: ModelConfig
    shard: Shard


class Runner(ABC):
    @abstractmethod
    def cache(self, cache: RequestCache | None, item: StepInput, end: int) -> RequestCache:
        """The request's cache (a new one when `cache` is None) able to hold `end` positions: `validate` has kept
        `end` within the model's context, and `item.max_positions`, when given, is the request's reservation."""

    @abstractmethod
    def run(self, x: np.ndarray, p: Packing, caches: list[RequestCache], all_logits: bool) -> np.ndarray:
        """Compute the step: x is the packed token ids (first shard) or float32 hidden rows. Returns float32 rows:
        hidden [rows, hidden] on a non-last shard; on the last, logits of each request's last row [requests,
        vocab], or of every row when `all_logits` (teacher-forced scoring: a runner may then prefer its exact
        eager path to a padded capture, whatever the shard)."""

    def drop(self, request_id: str) -> None:
        """Forget what the runner keeps for a released request (graphs that point at its cache)."""


class EagerRunner(Runner):
    """The shared model called op by op on the engine's `EagerBackend`, with boolean masks over each request's
    positions so far and layer caches that grow as they are written."""

    def __init__(self, engine: EngineParts):
        self.engine, self.ops, self.model = engine, engine.ops, engine.model
        cfg = engine.config
        self.group = cfg.n_heads // cfg.n_kv_heads
        self.inv_freq = np.asarray(cfg.rope.inv_freq(cfg.head_dim))
        self.masks = CausalMasks(True, False, bool)
        window = cfg.block.sliding  # sliding-window layers (Gemma): their masks, and their own rotary if they have one
        self.window_masks = None if window is None else CausalMasks(True, False, bool, window=window.size)
        self.local_inv_freq = (
            None if window is None or window.rope is None else np.asarray(window.rope.inv_freq(cfg.head_dim))
        )

    def cache(self, cache: RequestCache | None, item: StepInput, end: int) -> RequestCache:
        if cache is not None:
            return cache
        cfg, capacity = self.engine.config, item.max_positions
        if capacity is not None:  # a peer's number: never a cache larger than the model's context
            capacity = min(capacity, cfg.max_position_embeddings)
        return RequestCache([self.ops.new_cache(cfg.n_kv_heads, cfg.head_dim, capacity) for _ in self.model.layers])

    def step(self, p: Packing) -> Step:
        ops = self.ops
        rotary = ops.rotary(p.positions, self.inv_freq)
        sliding = None
        if self.window_masks is not None:
            local = rotary if self.local_inv_freq is None else ops.rotary(p.positions, self.local_inv_freq)
            sliding = Sliding(self.masks_of(self.window_masks, p), local)
        return Step(p.bounds, p.starts, p.positions, rotary, self.masks_of(self.masks, p), sliding)

    def masks_of(self, masks: CausalMasks, p: Packing) -> list:
        made = [allowed(masks, s, n, self.group) for s, n in zip(p.starts, p.lengths)]
        return [None if m is None else self.ops.array(m) for m in made]

    def run(self, x: np.ndarray, p: Packing, caches: list[RequestCache], all_logits: bool) -> np.ndarray:
        ops, shard = self.ops, self.engine.shard
        x = x if shard.is_first else ops.array(x)
        last_rows = p.last_rows if shard.is_last and not all_logits else None
        return ops.to_numpy(self.model(x, self.step(p), [c.layers for c in caches], last_rows))
