"""The interface every inference engine (numpy, tinygrad, mlx) implements.

Batch-first: one `forward` call advances many requests at once. Each request is a prefill (many positions) or a
decode step (one position); their rows are packed together so the weight matmuls run once for the whole batch,
while attention runs per request against that request's own KV cache.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from .config import ModelConfig
from .sampling import SampleResult, SamplingParams, SamplerState, sample_one, sample_rows
from .shard import Shard


class EngineInputError(ValueError):
    """A forward input is malformed: wrong dtype/shape, token id out of range, or context overflow."""


@dataclass(frozen=True)
class StepInput:
    """One request's positions for this step: token ids on the first shard, hidden states otherwise."""

    request_id: str
    tokens: np.ndarray | None = None  # int [T]
    hidden: np.ndarray | None = None  # float32 [T, hidden_size]

    @property
    def length(self) -> int:
        return len(self.tokens) if self.tokens is not None else len(self.hidden)


@dataclass(frozen=True)
class Packing:
    """How one step's requests are packed into rows: each request's rows, cache offsets and rotary tables."""

    lengths: list[int]
    starts: list[int]  # positions already cached per request
    bounds: np.ndarray  # request i owns rows bounds[i]:bounds[i+1]
    cos: np.ndarray  # float32 [rows, 1, head_dim/2], broadcast over heads
    sin: np.ndarray

    def split(self, out: np.ndarray, last_rows_only: bool) -> list[np.ndarray]:
        """Per-request slices of a packed output (`last_rows_only`: out holds one row per request)."""
        if last_rows_only:
            return [out[i : i + 1] for i in range(len(self.lengths))]
        return [out[self.bounds[i] : self.bounds[i + 1]] for i in range(len(self.lengths))]


class Engine(ABC):
    """Runs one shard's layers. Outputs are numpy float32 whatever the engine computes in."""

    name: str
    config: ModelConfig
    shard: Shard
    caches: dict  # request id -> that request's KV cache, in the engine's own representation

    @abstractmethod
    def forward(self, batch: list[StepInput], all_logits: bool = False) -> list[np.ndarray]:
        """Advance every request in `batch` (distinct request ids) by its positions.

        Returns per request, in order: hidden states [T, hidden] on a non-last shard; on the last shard logits
        [1, vocab] for the last position, or [T, vocab] for every position when `all_logits`.
        """

    def release(self, request_id: str) -> None:
        """Free the request's KV cache. Unknown ids are ignored (release is idempotent)."""
        self.caches.pop(request_id, None)

    @abstractmethod
    def cache_length(self, request_id: str) -> int:
        """Positions already cached for the request (0 if unknown)."""

    @property
    def active_requests(self) -> int:
        """How many requests hold a KV cache."""
        return len(self.caches)

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of weights this engine keeps for its shard."""

    # Whether `sample` takes a stacked batch. An engine without a batched sampler sets this False and the
    # last node's sampling batcher falls back to `sample_one` per request for its rows.
    batched_sampling: bool = True

    def sample(self, logits: np.ndarray, params: list[SamplingParams], states: list[SamplerState]) -> list[SampleResult]:
        """Batched sampler: one token per row of `logits` [N, vocab]; row i uses params[i] and advances states[i]."""
        return sample_rows(logits, params, states)

    def sample_one(self, logits: np.ndarray, params: SamplingParams, state: SamplerState) -> SampleResult:
        """Per-request sampler for one row [vocab]; must give the same token as `sample` would for that row."""
        return sample_one(logits, params, state)

    def pack(self, batch: list[StepInput]) -> Packing:
        """Validate a step's inputs and lay out its rows (shared by every engine, so all agree on positions)."""
        self.validate(batch)
        lengths = [item.length for item in batch]
        starts = [self.cache_length(item.request_id) for item in batch]
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
        angles = positions[:, None].astype(np.float64) * self.config.rope.inv_freq(self.config.head_dim)[None, :]
        return Packing(lengths, starts, np.cumsum([0] + lengths),
                       np.cos(angles).astype(np.float32)[:, None, :], np.sin(angles).astype(np.float32)[:, None, :])

    @staticmethod
    def tokens(batch: list[StepInput]) -> np.ndarray:
        return np.concatenate([item.tokens for item in batch])

    @staticmethod
    def hidden(batch: list[StepInput]) -> np.ndarray:
        return np.concatenate([item.hidden for item in batch])

    def validate(self, batch: list[StepInput]) -> None:
        cfg, ids = self.config, set()
        for item in batch:
            if item.request_id in ids:
                raise EngineInputError(f"request {item.request_id!r} appears twice in one batch")
            ids.add(item.request_id)
            if self.shard.is_first:
                t = item.tokens
                if t is None or t.ndim != 1 or t.dtype.kind not in "iu" or len(t) == 0:
                    raise EngineInputError(f"request {item.request_id!r}: first shard needs a non-empty 1-D int token array")
                if t.min() < 0 or t.max() >= cfg.vocab_size:
                    raise EngineInputError(f"request {item.request_id!r}: token id out of range [0, {cfg.vocab_size})")
            else:
                h = item.hidden
                if h is None or h.dtype != np.float32 or h.ndim != 2 or h.shape[0] == 0 or h.shape[1] != cfg.hidden_size:
                    raise EngineInputError(
                        f"request {item.request_id!r}: expected float32 hidden states [T>0, {cfg.hidden_size}]"
                    )
            end = self.cache_length(item.request_id) + item.length
            if end > cfg.max_position_embeddings:
                raise EngineInputError(
                    f"request {item.request_id!r}: {end} positions exceed max_position_embeddings "
                    f"{cfg.max_position_embeddings}"
                )
