"""The numpy engine: the shared Llama block over numpy float32 arrays (OpenBLAS matmuls).

Projection weights are kept as [in, out] contiguous matrices so `x @ W` over the packed rows of every request
is one BLAS call per projection: that is what makes batched decode pay.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shards.engines.backend import EagerBackend, SlabCache
from shards.engines.base import Engine
from shards.engines.moe_backend import NumpyMoE


class NumpyBackend(EagerBackend, NumpyMoE):
    name = "numpy"

    def weight(self, w: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(w.T, dtype=np.float32)

    def array(self, a: np.ndarray) -> np.ndarray:
        return np.asarray(a, dtype=np.float32) if a.dtype.kind == "f" else a

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return x

    def nbytes(self, x: np.ndarray) -> int:
        return x.nbytes

    def new_cache(self, n_kv_heads: int, head_dim: int, capacity: int | None = None) -> SlabCache:
        # np.empty: pages of a slab sized for the request's whole reservation are only backed as they are written
        return SlabCache(lambda shape: np.empty(shape, dtype=np.float32), n_kv_heads, head_dim, capacity)

    def linear(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        # OpenBLAS multiplies exactly two rows slower than two matrix-vector products (docs/benchmarks-log.md, figures
        # once in code): two streams decoding together made fewer tokens per second than one alone.
        y = np.stack([x[0] @ w, x[1] @ w]) if x.ndim == 2 and len(x) == 2 else x @ w
        if bias is not None:
            y += bias
        return y

    def embedding(self, table: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return table[ids]

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        var = np.mean(np.square(x), axis=-1, keepdims=True)
        return x * (1.0 / np.sqrt(var + eps)) * weight

    def silu(self, x: np.ndarray) -> np.ndarray:
        return x / (1.0 + np.exp(-x))

    def concat(self, xs: list[np.ndarray], axis: int) -> np.ndarray:
        return np.concatenate(xs, axis=axis)

    def transpose(self, x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        return x.transpose(axes)

    def softmax(self, x: np.ndarray) -> np.ndarray:
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        e /= e.sum(axis=-1, keepdims=True)
        return e

    def where(self, mask: np.ndarray, x: np.ndarray, fill: float) -> np.ndarray:
        return np.where(mask, x, np.float32(fill))

    def tanh(self, x: np.ndarray) -> np.ndarray:
        return np.tanh(x)


class NumpyEngine(Engine):
    name = "numpy"

    def make_backend(self, model_dir: Path) -> NumpyBackend:
        return NumpyBackend()
