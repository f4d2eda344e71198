"""The tinygrad engine: the shared Llama block over tinygrad tensors (GPU backends where present; on this machine its
CPU backend, which needs clang).

Weights keep the Hugging Face [out, in] layout and are applied as `x @ W.T` (measured ~5x faster than `x @ W` with
tinygrad's CPU kernels). Each request's KV cache is preallocated in capacity buckets and written at a symbolic
position, so decode steps are captured once per (batch size, capacities) with TinyJit and replayed, instead of
being compiled for every step. Activations leave as numpy float32.
"""
from __future__ import annotations

import numpy as np

try:
    from tinygrad import Tensor, TinyJit, Variable, dtypes
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("the tinygrad engine needs tinygrad: pip install 'exo-node[tinygrad]'") from e

from .backend import Backend, KVCache
from .engine import BlockEngine, Packing, StepInput
from .model import Step

MIN_CAPACITY = 256


class TinygradCache(KVCache):
    """One request's keys and values for one layer: [2, capacity, kv_heads, head_dim], capacity doubling."""

    def __init__(self, kv: "Tensor"):
        self.kv = kv
        self.length = 0

    @classmethod
    def empty(cls, n_kv: int, head_dim: int) -> "TinygradCache":
        return cls(Tensor.zeros(2, MIN_CAPACITY, n_kv, head_dim, dtype=dtypes.float32).contiguous().realize())

    def reserve(self, end: int) -> None:
        capacity = self.kv.shape[1]
        if end <= capacity:
            return
        while capacity < end:
            capacity *= 2
        grown = Tensor.zeros(2, capacity, *self.kv.shape[2:], dtype=dtypes.float32).contiguous().realize()
        if self.length:
            grown[:, : self.length].assign(self.kv[:, : self.length]).realize()
        self.kv = grown

    def update_and_fetch(self, k: "Tensor", v: "Tensor", start) -> tuple["Tensor", "Tensor"]:
        # `start` is an int, or a bound Variable while a decode step is being captured.
        t = k.shape[0]
        self.kv.shrink((None, (start, start + t), None, None)).assign(k.stack(v)).realize()
        if isinstance(start, int):
            self.length = start + t
        keys = self.kv[0].shrink(((0, start + t), None, None)).permute(1, 0, 2)  # [nkv, L, hd]
        values = self.kv[1].shrink(((0, start + t), None, None)).permute(1, 0, 2)
        return keys, values

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes()


class TinygradBackend(Backend):
    name = "tinygrad"

    def weight(self, w: np.ndarray) -> "Tensor":
        return self.array(w)  # [out, in], applied as x @ W.T

    def array(self, a: np.ndarray) -> "Tensor":
        return Tensor(np.ascontiguousarray(a, dtype=np.float32 if a.dtype.kind == "f" else a.dtype)).realize()

    def to_numpy(self, x: "Tensor") -> np.ndarray:
        return x.numpy().astype(np.float32, copy=False)

    def nbytes(self, x: "Tensor") -> int:
        return x.nbytes()

    def new_cache(self, n_kv_heads: int, head_dim: int, capacity: int | None = None) -> TinygradCache:
        # Capacity buckets (doubling from 256) rather than the request's reservation: each bucket is a captured
        # decode graph, so few distinct capacities keep captures few.
        return TinygradCache.empty(n_kv_heads, head_dim)

    def linear(self, x: "Tensor", w: "Tensor", bias: "Tensor | None" = None) -> "Tensor":
        return x @ w.T if bias is None else x @ w.T + bias

    def embedding(self, table: "Tensor", ids) -> "Tensor":
        return table[ids if isinstance(ids, Tensor) else Tensor(ids.astype(np.int32))]

    def rms_norm(self, x: "Tensor", weight: "Tensor", eps: float) -> "Tensor":
        return x * (x.square().mean(axis=-1, keepdim=True) + eps).rsqrt() * weight

    def silu(self, x: "Tensor") -> "Tensor":
        return x.silu()

    def concat(self, xs: list["Tensor"], axis: int) -> "Tensor":
        return xs[0].cat(*xs[1:], dim=axis)

    def transpose(self, x: "Tensor", axes: tuple[int, ...]) -> "Tensor":
        return x.permute(axes)

    def softmax(self, x: "Tensor") -> "Tensor":
        return x.softmax(-1)

    def where(self, mask: "Tensor", x: "Tensor", fill: float) -> "Tensor":
        return mask.where(x, fill)

    def take_rows(self, x: "Tensor", rows: np.ndarray) -> "Tensor":
        return x[Tensor(rows.astype(np.int32))]

    def layer_done(self, x: "Tensor", caches: list[KVCache]) -> "Tensor":
        return x.realize()


class TinygradEngine(BlockEngine):
    name = "tinygrad"
    # No batched sampler yet: the last node's sampling batcher samples tinygrad rows one request at a time.
    batched_sampling = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._jits: dict[tuple, TinyJit] = {}

    def make_backend(self) -> TinygradBackend:
        return TinygradBackend()

    def run(self, batch: list[StepInput], p: Packing, all_logits: bool) -> list[np.ndarray]:
        if max(p.lengths) > 1 or all_logits:
            return super().run(batch, p, all_logits)
        # Decode: replay captured kernels. Positions are symbolic (one variable per batch slot), so one capture
        # serves every step with this many requests and these cache capacities.
        caches = [self.request_cache(item.request_id) for item in batch]
        for cache, start in zip(caches, p.starts):
            for c in cache:
                c.reserve(start + 1)
        kvs = [c.kv for cache in caches for c in cache]
        key = (len(batch), tuple(kv.shape[1] for kv in kvs))
        jit = self._jits.get(key)
        if jit is None:
            jit = self._jits[key] = TinyJit(self._decode)
        pos = [Variable(f"start_pos{i}", 0, cache[0].kv.shape[1] - 1).bind(s)
               for i, (s, cache) in enumerate(zip(p.starts, caches))]
        x = Tensor(self.tokens(batch).astype(np.int32)) if self.shard.is_first else Tensor(self.hidden(batch))
        out = jit(x, Tensor(p.cos), Tensor(p.sin), *kvs, *pos).numpy()
        for cache, start in zip(caches, p.starts):
            for c in cache:
                c.length = start + 1
        return p.split(out, self.shard.is_last)

    def _decode(self, x: "Tensor", cos: "Tensor", sin: "Tensor", *args) -> "Tensor":
        """One decode step over caches given as arguments, so TinyJit swaps in each call's own buffers."""
        n, n_layers = x.shape[0], len(self.model.layers)
        kvs, pos = args[: n * n_layers], list(args[n * n_layers:])
        caches = [[TinygradCache(kv) for kv in kvs[r * n_layers:(r + 1) * n_layers]] for r in range(n)]
        step = Step(range(n + 1), pos, cos, sin, [None] * n)
        return self.model(x, step, caches, None).realize()
