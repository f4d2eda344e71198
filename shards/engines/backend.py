"""What an engine supplies to the shared Llama block (shards/transformer.py): its array operations and its KV cache.

The block is written once over a `Backend`; each engine (numpy, mlx, tinygrad, ...) subclasses it with its own
array library. Arrays are the library's own type; shapes below are in numpy order. Arithmetic the libraries share
(`+`, `*`, `@`, `.reshape`, basic slicing) is used on the arrays directly; everything whose spelling differs is a
method here. Attention with grouped-query heads is written once in terms of these primitives; a library with a
fused attention kernel may override `attention`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

Array = Any  # the backend library's array type


class KVCache(ABC):
    """One request's keys and values for one layer. The same contract for every engine, storage behind it."""

    length: int  # positions cached

    @abstractmethod
    def update_and_fetch(self, k: Array, v: Array, start: Any) -> tuple[Array, Array]:
        """Store keys/values [T, kv_heads, head_dim] of positions start..start+T-1 (`start` is `length` unless a
        backend traces the step with a symbolic position) and return every cached key and value so far, each
        [kv_heads, start+T, head_dim]."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of memory the cache holds (its capacity, not just its length)."""


class SlabCache(KVCache):
    """Keys and values in preallocated [kv_heads, capacity, head_dim] slabs, written in place and grown by doubling;
    fetches are views of the slabs, not copies. For libraries with in-place slice assignment (numpy, MLX)."""

    def __init__(self, zeros: Callable[[tuple[int, ...]], Array], n_kv: int, head_dim: int,
                 capacity: int | None = None):
        capacity = capacity or 64  # unknown: start small and double
        self.zeros = zeros
        self.k, self.v = zeros((n_kv, capacity, head_dim)), zeros((n_kv, capacity, head_dim))
        self.length = 0

    def update_and_fetch(self, k: Array, v: Array, start: int) -> tuple[Array, Array]:
        end = start + k.shape[0]
        if end > self.k.shape[1]:
            n_kv, capacity, head_dim = self.k.shape
            for name in ("k", "v"):
                grown = self.zeros((n_kv, max(end, 2 * capacity), head_dim))
                grown[:, :start] = getattr(self, name)[:, :start]
                setattr(self, name, grown)
        self.k[:, start:end] = k.transpose(1, 0, 2)
        self.v[:, start:end] = v.transpose(1, 0, 2)
        self.length = end
        return self.k[:, :end], self.v[:, :end]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class Backend(ABC):
    """Array operations of one library. Weights are converted once by `weight`; `linear` applies them."""

    name: str

    # -- conversions ------------------------------------------------------------------------------------------
    @abstractmethod
    def weight(self, w: np.ndarray) -> Array:
        """A projection matrix in Hugging Face [out, in] layout, in whatever layout `linear` wants."""

    def fused_weight(self, *parts: Any) -> Array:
        """One projection for several matrices stacked along `out` (q/k/v, gate/up): one matmul instead of three
        or two. Parts are float arrays for these engines; an engine keeping quantized blocks overrides this."""
        return self.weight(np.concatenate(parts))

    @abstractmethod
    def array(self, a: np.ndarray) -> Array:
        """A vector/table as it is (norm weights, biases, rotary tables, masks)."""

    def table(self, t: Any) -> Array:
        """The embedding table [vocab, hidden] that `embedding` looks rows up in."""
        return self.array(t)

    @abstractmethod
    def to_numpy(self, x: Array) -> np.ndarray:
        """float32 numpy, whatever the device: the form activations travel between nodes in."""

    @abstractmethod
    def nbytes(self, x: Array) -> int: ...

    @abstractmethod
    def new_cache(self, n_kv_heads: int, head_dim: int, capacity: int | None = None) -> KVCache:
        """An empty cache; `capacity`, when known, is the most positions the request will reach."""

    # -- operations -------------------------------------------------------------------------------------------
    @abstractmethod
    def linear(self, x: Array, w: Array, bias: Array | None = None) -> Array:
        """x [N, in] @ weight -> [N, out] (+ bias)."""

    @abstractmethod
    def embedding(self, table: Array, ids: np.ndarray) -> Array: ...

    @abstractmethod
    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        """Over the last axis, computed as x * (1 / sqrt(mean(x^2) + eps)) * weight."""

    @abstractmethod
    def silu(self, x: Array) -> Array: ...

    @abstractmethod
    def concat(self, xs: list[Array], axis: int) -> Array: ...

    @abstractmethod
    def transpose(self, x: Array, axes: tuple[int, ...]) -> Array: ...

    @abstractmethod
    def softmax(self, x: Array) -> Array:
        """Over the last axis."""

    @abstractmethod
    def where(self, mask: Array, x: Array, fill: float) -> Array: ...

    def take_rows(self, x: Array, rows: np.ndarray) -> Array:
        return x[rows]

    def layer_done(self, x: Array, caches: list[KVCache]) -> Array:
        """Called with each layer's output: lazy libraries evaluate here so the graph stays one layer deep."""
        return x

    # -- composite operations, written once ---------------------------------------------------------------------
    def rope(self, x: Array, cos: Array, sin: Array) -> Array:
        """Rotary embedding in the HF 'rotate_half' convention (pairs are (i, i + head_dim/2)); x [N, heads, hd],
        cos/sin [N, 1, hd/2]."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def attention(self, q: Array, keys: Array, values: Array, mask: Array | None, scale: float) -> Array:
        """Grouped-query attention of one request: q [T, heads, hd] against keys/values [kv_heads, L, hd];
        `mask` [1, group*T, L] (True = may attend) or None when every cached position may be seen. -> [T, heads*hd]
        """
        t, nh, hd = q.shape
        nkv = keys.shape[0]
        group = nh // nkv
        # Query heads sharing a kv head are adjacent: [T, nkv, group, hd] -> [nkv, group*T, hd], one matmul per kv head.
        qg = self.transpose(q.reshape(t, nkv, group, hd), (1, 2, 0, 3)).reshape(nkv, group * t, hd)
        scores = (qg @ self.transpose(keys, (0, 2, 1))) * scale
        if mask is not None:
            scores = self.where(mask, scores, float("-inf"))
        ctx = self.softmax(scores) @ values  # [nkv, group*T, hd]
        return self.transpose(ctx.reshape(nkv, group, t, hd), (2, 0, 1, 3)).reshape(t, nh * hd)
