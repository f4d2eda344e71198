"""What an engine supplies to the shared Llama block (shards/model/transformer.py): its array operations and its KV caches.

The block is written once over a `Backend`: the operations it calls, and nothing else, so every backend implements
all of its contract. Arrays are the library's own type; shapes below are in numpy order. Arithmetic the libraries
share (`+`, `*`, `@`, `.reshape`, basic slicing) is used on the arrays directly; everything whose spelling differs is
a method. An `EagerBackend` (numpy, MLX, tinygrad) computes as it goes and gets rotary embedding and grouped-query
attention written once over a few more primitives (`transpose`, `softmax`, `where`); a graph backend (ggml) builds
nodes instead and supplies its own fused `rope` and `attention`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

Array = Any  # the backend library's array type
Rotary = Any  # what a backend's `rotary` makes of the rows' positions (cos/sin tables, or the positions themselves)


def rotary_tables(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin float32 [len(positions), 1, head_dim/2] (broadcast over heads), angles in float64."""
    angles = np.asarray(positions)[:, None].astype(np.float64) * np.asarray(inv_freq)[None, :]
    return np.cos(angles).astype(np.float32)[:, None, :], np.sin(angles).astype(np.float32)[:, None, :]


class KVCache(ABC):
    """One request's keys and values for one layer. The same contract for every engine, storage behind it. A layer
    cache keeps no length: how many positions a request holds is its `RequestCache`'s, advanced once per step."""

    @abstractmethod
    def update_and_fetch(self, k: Array, v: Array, start: Any) -> tuple[Array, Array]:
        """Store keys/values [T, kv_heads, head_dim] of positions start..start+T-1 (`start` is the request's
        length, or a symbolic position where a backend traces the step) and return the cached keys and values the
        step attends, each [kv_heads, cells, head_dim] (cells: start+T, or a padded span the masks cover)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of memory the cache holds (its capacity, not just its length)."""

    def copy_span(self, start: int, n: int) -> KVCache:
        """A new layer cache holding a copy of this one's positions [start, start+n) as its first n (this one
        unchanged)."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy positions")

    def write_span(self, src: KVCache, n: int, at: int) -> None:
        """Write `src`'s first n positions as this cache's positions [at, at+n) (growing it; the positions below `at`
        kept). `src` is a cache of the same storage."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy positions")


class SlabCache(KVCache):
    """Keys and values in preallocated [kv_heads, capacity, head_dim] slabs, written in place and grown by doubling;
    fetches are views of the slabs, not copies. For libraries with in-place slice assignment (numpy, MLX)."""

    def __init__(
        self, zeros: Callable[[tuple[int, ...]], Array], n_kv: int, head_dim: int, capacity: int | None = None
    ):
        capacity = capacity or 64  # unknown: start small and double
        self.zeros = zeros
        self.k, self.v = zeros((n_kv, capacity, head_dim)), zeros((n_kv, capacity, head_dim))

    def reserve(self, end: int, keep: int) -> None:
        """Room for `end` positions (at least doubled when grown), the first `keep` kept."""
        if end > self.k.shape[1]:
            n_kv, capacity, head_dim = self.k.shape
            for name in ("k", "v"):
                grown = self.zeros((n_kv, max(end, 2 * capacity), head_dim))
                grown[:, :keep] = getattr(self, name)[:, :keep]
                setattr(self, name, grown)

    def update_and_fetch(self, k: Array, v: Array, start: int) -> tuple[Array, Array]:
        end = start + k.shape[0]
        self.reserve(end, start)
        self.k[:, start:end] = k.transpose(1, 0, 2)
        self.v[:, start:end] = v.transpose(1, 0, 2)
        return self.k[:, :end], self.v[:, :end]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def copy_span(self, start: int, n: int) -> SlabCache:
        n_kv, _, head_dim = self.k.shape
        copy = SlabCache(self.zeros, n_kv, head_dim, n)
        copy.write_span(self, n, 0, start)
        return copy

    def write_span(self, src: SlabCache, n: int, at: int, src_start: int = 0) -> None:
        self.reserve(at + n, at)
        self.k[:, at : at + n] = src.k[:, src_start : src_start + n]
        self.v[:, at : at + n] = src.v[:, src_start : src_start + n]


class RequestCache:
    """Every layer's cache of one request, and how many positions they hold.

    Only `commit` advances `length`, and the engine calls it once per step after every layer has written the step's
    positions: a step that fails leaves the length where it was, and no layer, runner or engine keeps a second
    count that could disagree."""

    def __init__(self, layers: list):
        self.layers = layers
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def commit(self, positions: int) -> None:
        """The step just run wrote `positions` more positions into every layer."""
        if positions < 1:
            raise ValueError(f"a step commits at least one position, not {positions}")
        self._length += positions

    def copy_prefix(self, positions: int, room: int = 0) -> RequestCache:
        """A new cache holding a copy of this one's first `positions` positions, this one unchanged: a request that
        shares only part of a retained prefix starts from the copy, and the prefix stays retained for the next
        (shards/engines/retained.py). `room`: positions the copy will hold soon (a hint to storage that sizes
        ranges). Raises NotImplementedError where the storage can't copy."""
        return self.copy_span(0, positions, room)

    def copy_span(self, start: int, end: int, room: int = 0) -> RequestCache:
        """A new cache holding a copy of this one's positions [start, end) as its first end - start: a retained
        branch keeps only what its parent does not hold (shards/engines/retained.py)."""
        if not 0 <= start < end <= self._length:
            raise ValueError(f"cannot copy positions [{start}, {end}) of a cache of {self._length}")
        copy = RequestCache([layer.copy_span(start, end - start) for layer in self.layers])
        copy._length = end - start
        return copy

    def append_from(self, src: RequestCache, n: int) -> None:
        """Write `src`'s first n positions after this cache's own (a retained chain assembled, root first, into one
        request's cache) and count them."""
        if not 1 <= n <= src.length:
            raise ValueError(f"cannot append {n} positions of a cache of {src.length}")
        for layer, other in zip(self.layers, src.layers, strict=True):
            layer.write_span(other, n, self._length)
        self._length += n

    def truncate(self, positions: int) -> None:
        """Keep only the first `positions` positions (a later request reuses this prefix: see
        shards/engines/retained.py); the cells past them are rewritten before they are read."""
        if not 0 <= positions <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} positions to {positions}")
        self._length = positions

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def free(self) -> None:
        self.layers = []


class Backend(ABC):
    """What the shared block calls, and all of it: a backend implements every method here. Weights are converted
    once by `weight`; `linear` applies them."""

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
        """A vector/table as it is (norm weights, biases, masks)."""

    def table(self, t: Any) -> Array:
        """The embedding table [vocab, hidden] that `embedding` looks rows up in."""
        return self.array(t)

    @abstractmethod
    def to_numpy(self, x: Array) -> np.ndarray:
        """float32 numpy, whatever the device: the form activations travel between nodes in."""

    @abstractmethod
    def nbytes(self, x: Array) -> int: ...

    # -- operations -------------------------------------------------------------------------------------------
    @abstractmethod
    def linear(self, x: Array, w: Array, bias: Array | None = None) -> Array:
        """x [N, in] @ weight -> [N, out] (+ bias)."""

    @abstractmethod
    def embedding(self, table: Array, ids: Array) -> Array: ...

    @abstractmethod
    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        """Over the last axis, computed as x * (1 / sqrt(mean(x^2) + eps)) * weight."""

    @abstractmethod
    def silu(self, x: Array) -> Array: ...

    def gated(self, gate_up: Array, width: int, act: str) -> Array:
        """act(gate_up[:, :width]) * gate_up[:, width:], act "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU): the
        feed-forward's gate over its fused projection. A graph backend fuses it into one op on the whole rows (a
        device's kernels for the activation alone may want contiguous input, which the halves are not)."""
        gate, up = gate_up[:, :width], gate_up[:, width:]
        return (self.silu(gate) if act == "silu" else self.gelu_tanh(gate)) * up

    # Gemma's operations (formats/block_config.py), called only for a model whose flags ask for them: every backend
    # here implements them (EagerBackend once for numpy, MLX and tinygrad; ggml in ggml/gemma_ops.py).
    def gelu_tanh(self, x: Array) -> Array:
        """GELU in its tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Gemma's GeGLU gate)."""
        raise NotImplementedError(f"the {self.name} backend has no gelu_tanh (Gemma's GeGLU)")

    def scale(self, x: Array, factor: float) -> Array:
        """x times a float32 scalar (Gemma's embedding scale)."""
        raise NotImplementedError(f"the {self.name} backend has no scale (Gemma's embedding scale)")

    def softcap(self, x: Array, cap: float) -> Array:
        """cap * tanh(x / cap): values squashed smoothly into (-cap, cap) (Gemma's logit soft-capping)."""
        raise NotImplementedError(f"the {self.name} backend has no softcap (Gemma's logit soft-capping)")

    @abstractmethod
    def concat(self, xs: list[Array], axis: int) -> Array: ...

    def take_rows(self, x: Array, rows: Array) -> Array:
        return x[rows]

    def layer_done(self, x: Array, caches: list[KVCache]) -> Array:
        """Called with each layer's output: lazy libraries evaluate here so the graph stays one layer deep."""
        return x

    @abstractmethod
    def rotary(self, positions: Array, inv_freq: np.ndarray) -> Rotary:
        """What `rope` needs for rows at `positions` (one per row), made once per step for every layer: cos/sin
        tables from the model's per-pair frequencies `inv_freq`, or, for a backend computing the angles itself,
        the positions as they are."""

    @abstractmethod
    def rope(self, x: Array, rotary: Rotary) -> Array:
        """Rotary embedding of x [N, heads, hd] in the Hugging Face 'rotate_half' convention (pairs (i, i + hd/2))
        unless the weights' rows say otherwise (ggml, llama GGUFs)."""

    @abstractmethod
    def attention(
        self, q: Array, keys: Array, values: Array, mask: Array | None, scale: float, softcap: float | None = None
    ) -> Array:
        """Grouped-query attention of one request: q [T, heads, hd] against keys/values [kv_heads, cells, hd],
        `mask` in the backend's form (see shards/engines/masks.py) or None when every cell may be seen; with
        `softcap`, the scaled scores are soft-capped before the mask and the softmax (Gemma 2). -> [T, heads*hd]"""


class EagerBackend(Backend):
    """A library that computes as it goes (numpy, MLX, tinygrad): rotary embedding and attention written once over
    `transpose`, `softmax` and `where`, and caches in the library's arrays."""

    @abstractmethod
    def new_cache(self, n_kv_heads: int, head_dim: int, capacity: int | None = None) -> KVCache:
        """An empty layer cache; `capacity`, when known, is the most positions the request will reach."""

    @abstractmethod
    def transpose(self, x: Array, axes: tuple[int, ...]) -> Array: ...

    @abstractmethod
    def softmax(self, x: Array) -> Array:
        """Over the last axis."""

    @abstractmethod
    def where(self, mask: Array, x: Array, fill: float) -> Array: ...

    @abstractmethod
    def tanh(self, x: Array) -> Array: ...

    # -- composite operations, written once ---------------------------------------------------------------------
    def gelu_tanh(self, x: Array) -> Array:
        return 0.5 * x * (1.0 + self.tanh(0.7978845608028654 * (x + 0.044715 * (x * x * x))))

    def scale(self, x: Array, factor: float) -> Array:
        return x * factor

    def softcap(self, x: Array, cap: float) -> Array:
        return self.tanh(x * (1.0 / cap)) * cap

    def rotary(self, positions: np.ndarray, inv_freq: np.ndarray) -> tuple[Array, Array]:
        """cos and sin tables [N, 1, hd/2] (see `rotary_tables`)."""
        return tuple(self.array(t) for t in rotary_tables(positions, inv_freq))

    def rope(self, x: Array, rotary: tuple[Array, Array]) -> Array:
        """x [N, heads, hd] rotated by the cos/sin tables [N, 1, hd/2] of `rotary`."""
        cos, sin = rotary
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def attention(
        self, q: Array, keys: Array, values: Array, mask: Array | None, scale: float, softcap: float | None = None
    ) -> Array:
        """`mask` [1, group*T, cells] (True = may attend), as `masks.allowed` makes it. -> [T, heads*hd]"""
        t, nh, hd = q.shape
        nkv = keys.shape[0]
        group = nh // nkv
        # Query heads sharing a kv head are adjacent: [T, nkv, group, hd] -> [nkv, group*T, hd], one matmul per kv head.
        qg = self.transpose(q.reshape(t, nkv, group, hd), (1, 2, 0, 3)).reshape(nkv, group * t, hd)
        scores = (qg @ self.transpose(keys, (0, 2, 1))) * scale
        if softcap is not None:
            scores = self.softcap(scores, softcap)
        if mask is not None:
            scores = self.where(mask, scores, float("-inf"))
        ctx = self.softmax(scores) @ values  # [nkv, group*T, hd]
        return self.transpose(ctx.reshape(nkv, group, t, hd), (2, 0, 1, 3)).reshape(t, nh * hd)
