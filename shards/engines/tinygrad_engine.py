"""The tinygrad engine: the shared Llama block over tinygrad tensors (GPU backends where present; on this machine its
CPU backend, which needs clang).

Weights keep the Hugging Face [out, in] layout and are applied as `x @ W.T` (measured ~5x faster than `x @ W` with
tinygrad's CPU kernels). Each request's KV cache is preallocated in capacity buckets and written at a symbolic
position, so decode steps are captured once per (batch size, capacities) with TinyJit and replayed, instead of
being compiled for every step. Prompt chunks are padded to length buckets (16/64/256) and attend over the cache's
whole capacity with a mask from the true lengths, so a prefill is captured once per (requests, bucket,
capacities): a new prompt length no longer compiles new kernels. Activations leave as numpy float32.
"""
from __future__ import annotations

import numpy as np

try:
    from tinygrad import Tensor, TinyJit, Variable, dtypes
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("the tinygrad engine needs tinygrad: pip install 'exo-node[tinygrad]'") from e

from shards.engines.backend import Backend, KVCache
from shards.engines.base import BlockEngine, Packing, StepInput
from shards.transformer import Step

MIN_CAPACITY = 256


class TinygradCache(KVCache):
    """One request's keys and values for one layer: [2, capacity, kv_heads, head_dim], capacity doubling.

    `whole`: fetch the whole capacity (a padded prefill, which masks what lies beyond each position) instead of the
    positions written so far."""

    def __init__(self, kv: "Tensor", whole: bool = False):
        self.kv, self.whole = kv, whole
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
        end = self.kv.shape[1] if self.whole else start + t
        keys = self.kv[0].shrink(((0, end), None, None)).permute(1, 0, 2)  # [nkv, L, hd]
        values = self.kv[1].shrink(((0, end), None, None)).permute(1, 0, 2)
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

    def take_rows(self, x: "Tensor", rows) -> "Tensor":
        return x[rows if isinstance(rows, Tensor) else Tensor(rows.astype(np.int32))]

    def layer_done(self, x: "Tensor", caches: list[KVCache]) -> "Tensor":
        return x.realize()


class TinygradEngine(BlockEngine):
    name = "tinygrad"
    # No batched sampler yet: the last node's sampling batcher samples tinygrad rows one request at a time.
    batched_sampling = False
    prefill_buckets = (16, 64, 256)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._jits: dict[tuple, TinyJit] = {}

    def make_backend(self) -> TinygradBackend:
        return TinygradBackend()

    def run(self, batch: list[StepInput], p: Packing, all_logits: bool) -> list[np.ndarray]:
        if all_logits:
            return super().run(batch, p, all_logits)
        if max(p.lengths) > 1:
            buckets = {next((b for b in self.prefill_buckets if b >= n), None) for n in p.lengths}
            if len(buckets) == 1 and None not in buckets:
                return self._padded_prefill(batch, p, buckets.pop())
            return super().run(batch, p, all_logits)  # lengths of several buckets, or beyond the largest
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

    def _padded_prefill(self, batch: list[StepInput], p: Packing, bucket: int) -> list[np.ndarray]:
        """Every request's chunk padded to `bucket` rows, through a capture for this (requests, bucket, capacities).
        Pad rows write cache positions beyond the true length (overwritten by the next chunk or token) and their
        outputs are dropped; the masks come from the true lengths, so a real token 0 is still input."""
        caches = [self.request_cache(item.request_id, item.max_positions) for item in batch]
        for cache, start in zip(caches, p.starts):
            for c in cache:
                c.reserve(start + bucket)
        kvs = [c.kv for cache in caches for c in cache]
        capacities = [cache[0].kv.shape[1] for cache in caches]
        key = ("prefill", len(batch), bucket, tuple(kv.shape[1] for kv in kvs))
        jit = self._jits.get(key)
        if jit is None:
            jit = self._jits[key] = TinyJit(self._prefill)
        group = self.config.n_heads // self.config.n_kv_heads
        cos, sin = self.rotary(np.concatenate([np.arange(s, s + bucket) for s in p.starts]))
        masks = [Tensor(np.tile(np.arange(cap)[None, :] <= (s + np.arange(bucket))[:, None], (group, 1))[None])
                 for s, cap in zip(p.starts, capacities)]
        last = Tensor(np.array([i * bucket + n - 1 for i, n in enumerate(p.lengths)], dtype=np.int32))
        pos = [Variable(f"start_pos{i}", 0, cap - 1).bind(s) for i, (s, cap) in enumerate(zip(p.starts, capacities))]
        if self.shard.is_first:
            x = Tensor(np.concatenate([np.pad(item.tokens, (0, bucket - len(item.tokens))) for item in batch])
                       .astype(np.int32))
        else:
            x = Tensor(np.concatenate([np.pad(item.hidden, ((0, bucket - len(item.hidden)), (0, 0))) for item in batch]))
        out = jit(x, Tensor(cos), Tensor(sin), last, *masks, *kvs, *pos).numpy()
        for cache, start, n in zip(caches, p.starts, p.lengths):
            for c in cache:
                c.length = start + n
        if self.shard.is_last:
            return p.split(out, True)
        return [out[i * bucket: i * bucket + n] for i, n in enumerate(p.lengths)]

    def _prefill(self, x: "Tensor", cos: "Tensor", sin: "Tensor", last: "Tensor", *args) -> "Tensor":
        """One padded prefill step over caches and masks given as arguments (see `_decode`)."""
        n, n_layers = last.shape[0], len(self.model.layers)
        masks, kvs, pos = args[:n], args[n: n + n * n_layers], list(args[n + n * n_layers:])
        caches = [[TinygradCache(kv, whole=True) for kv in kvs[r * n_layers:(r + 1) * n_layers]] for r in range(n)]
        bucket = x.shape[0] // n
        step = Step(range(0, n * bucket + 1, bucket), pos, cos, sin, masks)
        return self.model(x, step, caches, last if self.shard.is_last else None).realize()

    def _decode(self, x: "Tensor", cos: "Tensor", sin: "Tensor", *args) -> "Tensor":
        """One decode step over caches given as arguments, so TinyJit swaps in each call's own buffers."""
        n, n_layers = x.shape[0], len(self.model.layers)
        kvs, pos = args[: n * n_layers], list(args[n * n_layers:])
        caches = [[TinygradCache(kv) for kv in kvs[r * n_layers:(r + 1) * n_layers]] for r in range(n)]
        step = Step(range(n + 1), pos, cos, sin, [None] * n)
        return self.model(x, step, caches, None).realize()
