"""The tinygrad engine: the shared Llama block over tinygrad tensors (GPU backends where present; without one, its
CPU backend, which needs clang).

Weights keep the Hugging Face [out, in] layout and are applied as `x @ W.T` (faster than `x @ W` with tinygrad's
CPU kernels: docs/benchmarks-log.md, figures once in code). Each request's KV cache is preallocated in capacity buckets and written at a symbolic
position, so decode steps are captured once per (batch size, capacities) with TinyJit and replayed, instead of
being compiled for every step. Prompt chunks are padded to length buckets (16/64/256) and attend over the cache's
whole capacity with a mask from the true lengths, so a prefill is captured once per (requests, bucket,
capacities): a new prompt length no longer compiles new kernels. Both are `TinyJitRunner`, the engine's runner for
`Engine.run`; other shapes (every row's logits, chunks of several buckets) and models with sliding-window
layers run eagerly. Activations leave as numpy float32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

try:
    from tinygrad import Tensor, TinyJit, Variable, dtypes
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("the tinygrad engine needs tinygrad: pip install 'exo-node[tinygrad]'") from e

from shards.engines.backend import EagerBackend, KVCache, RequestCache, rotary_tables
from shards.engines.base import Engine, Packing, StepInput
from shards.engines.runner import EagerRunner
from shards.model.transformer import Step

MIN_CAPACITY = 256


class TinygradCache(KVCache):
    """One request's keys and values for one layer: [2, capacity, kv_heads, head_dim], capacity doubling.

    `whole`: fetch the whole capacity (a padded prefill, which masks what lies beyond each position) instead of the
    positions written so far."""

    def __init__(self, kv: Tensor, whole: bool = False):
        self.kv, self.whole = kv, whole

    @classmethod
    def empty(cls, n_kv: int, head_dim: int) -> TinygradCache:
        return cls(Tensor.zeros(2, MIN_CAPACITY, n_kv, head_dim, dtype=dtypes.float32).contiguous().realize())

    def reserve(self, end: int, length: int) -> None:
        """Room for `end` positions, keeping the `length` already written."""
        capacity = self.kv.shape[1]
        if end <= capacity:
            return
        while capacity < end:
            capacity *= 2
        grown = Tensor.zeros(2, capacity, *self.kv.shape[2:], dtype=dtypes.float32).contiguous().realize()
        if length:
            grown[:, :length].assign(self.kv[:, :length]).realize()
        self.kv = grown

    def copy_span(self, start: int, n: int) -> TinygradCache:
        copy = TinygradCache.empty(*self.kv.shape[2:])
        copy.whole = self.whole
        copy.write_span(self, n, 0, start)
        return copy

    def write_span(self, src: TinygradCache, n: int, at: int, src_start: int = 0) -> None:
        self.reserve(at + n, at)
        self.kv.shrink((None, (at, at + n), None, None)).assign(
            src.kv.shrink((None, (src_start, src_start + n), None, None))
        ).realize()

    def update_and_fetch(self, k: Tensor, v: Tensor, start) -> tuple[Tensor, Tensor]:
        # `start` is an int, or a bound Variable while a decode step is being captured.
        t = k.shape[0]
        self.kv.shrink((None, (start, start + t), None, None)).assign(k.stack(v)).realize()
        end = self.kv.shape[1] if self.whole else start + t
        keys = self.kv[0].shrink(((0, end), None, None)).permute(1, 0, 2)  # [nkv, L, hd]
        values = self.kv[1].shrink(((0, end), None, None)).permute(1, 0, 2)
        return keys, values

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes()


class TinygradBackend(EagerBackend):
    name = "tinygrad"

    def weight(self, w: np.ndarray) -> Tensor:
        return self.array(w)  # [out, in], applied as x @ W.T

    def array(self, a: np.ndarray) -> Tensor:
        return Tensor(np.ascontiguousarray(a, dtype=np.float32 if a.dtype.kind == "f" else a.dtype)).realize()

    def to_numpy(self, x: Tensor) -> np.ndarray:
        return x.numpy().astype(np.float32, copy=False)

    def nbytes(self, x: Tensor) -> int:
        return x.nbytes()

    def new_cache(self, n_kv_heads: int, head_dim: int, capacity: int | None = None) -> TinygradCache:
        # Capacity buckets (doubling from 256) rather than the request's reservation: each bucket is a captured
        # decode graph, so few distinct capacities keep captures few.
        return TinygradCache.empty(n_kv_heads, head_dim)

    def linear(self, x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
        return x @ w.T if bias is None else x @ w.T + bias

    def embedding(self, table: Tensor, ids) -> Tensor:
        return table[ids if isinstance(ids, Tensor) else Tensor(ids.astype(np.int32))]

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return x * (x.square().mean(axis=-1, keepdim=True) + eps).rsqrt() * weight

    def silu(self, x: Tensor) -> Tensor:
        return x.silu()

    def concat(self, xs: list[Tensor], axis: int) -> Tensor:
        return xs[0].cat(*xs[1:], dim=axis)

    def transpose(self, x: Tensor, axes: tuple[int, ...]) -> Tensor:
        return x.permute(axes)

    def softmax(self, x: Tensor) -> Tensor:
        return x.softmax(-1)

    def where(self, mask: Tensor, x: Tensor, fill: float) -> Tensor:
        return mask.where(x, fill)

    def tanh(self, x: Tensor) -> Tensor:
        return x.tanh()

    def take_rows(self, x: Tensor, rows) -> Tensor:
        return x[rows if isinstance(rows, Tensor) else Tensor(rows.astype(np.int32))]

    def layer_done(self, x: Tensor, caches: list[KVCache]) -> Tensor:
        return x.realize()


class TinyJitRunner(EagerRunner):
    """Decode steps and bucketed prefills through TinyJit captures keyed by their shapes; anything else eagerly."""

    def __init__(self, engine: TinygradEngine):
        super().__init__(engine)
        self.buckets = engine.prefill_buckets
        self._jits: dict[tuple, TinyJit] = {}

    def cache(self, cache: RequestCache | None, item: StepInput, end: int) -> RequestCache:
        if cache is None:
            cfg = self.engine.config
            cache = RequestCache([TinygradCache.empty(cfg.n_kv_heads, cfg.head_dim) for _ in self.model.layers])
        for layer in cache.layers:
            layer.reserve(end, cache.length)
        return cache

    def run(self, x: np.ndarray, p: Packing, caches: list[RequestCache], all_logits: bool) -> np.ndarray:
        # Sliding-window layers (Gemma) run eagerly: their masks hide cells behind the window in decode steps too,
        # which the captured decode (no mask, symbolic length) does not take.
        if all_logits or self.engine.config.block.sliding is not None:
            return super().run(x, p, caches, all_logits)
        if max(p.lengths) > 1:
            buckets = {next((b for b in self.buckets if b >= n), None) for n in p.lengths}
            if len(buckets) == 1 and None not in buckets:
                return self._padded_prefill(x, p, caches, buckets.pop())
            return super().run(x, p, caches, all_logits)  # lengths of several buckets, or beyond the largest
        # Decode: replay captured kernels. Positions are symbolic (one variable per batch slot), so one capture
        # serves every step with this many requests and these cache capacities.
        kvs = [c.kv for cache in caches for c in cache.layers]
        key = (len(caches), tuple(kv.shape[1] for kv in kvs))
        jit = self._jits.get(key)
        if jit is None:
            jit = self._jits[key] = TinyJit(self._decode)
        pos = [
            Variable(f"start_pos{i}", 0, cache.layers[0].kv.shape[1] - 1).bind(s)
            for i, (s, cache) in enumerate(zip(p.starts, caches))
        ]
        cos, sin = rotary_tables(p.positions, self.inv_freq)
        x = Tensor(x.astype(np.int32)) if self.engine.shard.is_first else Tensor(x)
        return jit(x, Tensor(cos), Tensor(sin), *kvs, *pos).numpy()

    def _padded_prefill(self, x: np.ndarray, p: Packing, caches: list[RequestCache], bucket: int) -> np.ndarray:
        """Every request's chunk padded to `bucket` rows, through a capture for this (requests, bucket, capacities).
        Pad rows write cache positions beyond the true length (overwritten by the next chunk or token) and their
        outputs are dropped; the masks come from the true lengths, so a real token 0 is still input."""
        for cache, start in zip(caches, p.starts):
            for c in cache.layers:
                c.reserve(start + bucket, cache.length)
        kvs = [c.kv for cache in caches for c in cache.layers]
        capacities = [cache.layers[0].kv.shape[1] for cache in caches]
        key = ("prefill", len(caches), bucket, tuple(kv.shape[1] for kv in kvs))
        jit = self._jits.get(key)
        if jit is None:
            jit = self._jits[key] = TinyJit(self._prefill)
        cos, sin = rotary_tables(np.concatenate([np.arange(s, s + bucket) for s in p.starts]), self.inv_freq)
        masks = [
            Tensor(np.tile(self.masks(s, bucket, cap), (self.group, 1))[None]) for s, cap in zip(p.starts, capacities)
        ]
        last = Tensor(np.array([i * bucket + n - 1 for i, n in enumerate(p.lengths)], dtype=np.int32))
        pos = [Variable(f"start_pos{i}", 0, cap - 1).bind(s) for i, (s, cap) in enumerate(zip(p.starts, capacities))]
        pieces = np.split(x, p.bounds[1:-1])
        if self.engine.shard.is_first:
            x = Tensor(np.concatenate([np.pad(t, (0, bucket - len(t))) for t in pieces]).astype(np.int32))
        else:
            x = Tensor(np.concatenate([np.pad(h, ((0, bucket - len(h)), (0, 0))) for h in pieces]))
        out = jit(x, Tensor(cos), Tensor(sin), last, *masks, *kvs, *pos).numpy()
        if self.engine.shard.is_last:
            return out
        return np.concatenate([out[i * bucket : i * bucket + n] for i, n in enumerate(p.lengths)])

    def _prefill(self, x: Tensor, cos: Tensor, sin: Tensor, last: Tensor, *args) -> Tensor:
        """One padded prefill step over caches and masks given as arguments (see `_decode`)."""
        n, n_layers = last.shape[0], len(self.model.layers)
        masks, kvs, pos = args[:n], args[n : n + n * n_layers], list(args[n + n * n_layers :])
        caches = [[TinygradCache(kv, whole=True) for kv in kvs[r * n_layers : (r + 1) * n_layers]] for r in range(n)]
        bucket = x.shape[0] // n
        step = Step(range(0, n * bucket + 1, bucket), pos, None, (cos, sin), masks)
        return self.model(x, step, caches, last if self.engine.shard.is_last else None).realize()

    def _decode(self, x: Tensor, cos: Tensor, sin: Tensor, *args) -> Tensor:
        """One decode step over caches given as arguments, so TinyJit swaps in each call's own buffers."""
        n, n_layers = x.shape[0], len(self.model.layers)
        kvs, pos = args[: n * n_layers], list(args[n * n_layers :])
        caches = [[TinygradCache(kv) for kv in kvs[r * n_layers : (r + 1) * n_layers]] for r in range(n)]
        step = Step(range(n + 1), pos, None, (cos, sin), [None] * n)
        return self.model(x, step, caches, None).realize()


class TinygradEngine(Engine):
    name = "tinygrad"
    # No batched sampler yet: the last node's sampling batcher samples tinygrad rows one request at a time.
    batched_sampling = False
    prefill_buckets = (16, 64, 256)

    def make_backend(self, model_dir: Path) -> TinygradBackend:
        return TinygradBackend()

    def make_runner(self) -> TinyJitRunner:
        return TinyJitRunner(self)
