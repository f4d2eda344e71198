"""The MLX engine: the shared Llama block over MLX arrays (Apple Silicon's GPU; on Linux mlx[cpu] runs on the CPU).

Activations leave as numpy float32, whatever the device. MLX is lazy: each layer's output is evaluated before the
next layer is built, so the graph never grows beyond one layer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

try:
    import mlx.core as mx
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("the mlx engine needs MLX: pip install 'exo-node[mlx]'") from e

from shards.engines.backend import EagerBackend, KVCache, SlabCache
from shards.engines.base import Engine
from shards.engines.moe_backend import EagerMoE


class MlxBackend(EagerBackend, EagerMoE):
    name = "mlx"

    def weight(self, w: np.ndarray) -> mx.array:
        return mx.array(np.ascontiguousarray(w.T, dtype=np.float32))  # [in, out]

    def array(self, a: np.ndarray) -> mx.array:
        return mx.array(a)

    def to_numpy(self, x: mx.array) -> np.ndarray:
        return np.array(x, dtype=np.float32)

    def nbytes(self, x: mx.array) -> int:
        return x.nbytes

    def new_cache(self, n_kv_heads: int, head_dim: int, capacity: int | None = None) -> SlabCache:
        return SlabCache(lambda shape: mx.zeros(shape, mx.float32), n_kv_heads, head_dim, capacity)

    def linear(self, x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
        return x @ w if bias is None else x @ w + bias

    def embedding(self, table: mx.array, ids: np.ndarray) -> mx.array:
        return table[mx.array(ids.astype(np.int32))]

    def rms_norm(self, x: mx.array, weight: mx.array, eps: float) -> mx.array:
        return x * mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + eps) * weight

    def silu(self, x: mx.array) -> mx.array:
        return x * mx.sigmoid(x)

    def sigmoid(self, x: mx.array) -> mx.array:
        return mx.sigmoid(x)

    def concat(self, xs: list[mx.array], axis: int) -> mx.array:
        return mx.concatenate(xs, axis=axis)

    def transpose(self, x: mx.array, axes: tuple[int, ...]) -> mx.array:
        return x.transpose(axes)

    def softmax(self, x: mx.array) -> mx.array:
        return mx.softmax(x, axis=-1)

    def where(self, mask: mx.array, x: mx.array, fill: float) -> mx.array:
        return mx.where(mask, x, fill)

    def tanh(self, x: mx.array) -> mx.array:
        return mx.tanh(x)

    def take_rows(self, x: mx.array, rows: np.ndarray) -> mx.array:
        return x[mx.array(rows)]

    def layer_done(self, x: mx.array, caches: list[KVCache]) -> mx.array:
        mx.eval(x, [(c.k, c.v) for c in caches])  # keep the lazy graph one layer deep
        return x


class MlxEngine(Engine):
    name = "mlx"

    def make_backend(self, model_dir: Path) -> MlxBackend:
        return MlxBackend()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        mx.eval(self.model.parameters())
