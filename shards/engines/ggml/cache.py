"""KV caches of the ggml engine: per request, per layer, F16, in memory the engine maps itself.

A request's cache is sized once from its reservation (StepInput.max_positions) and, when that is unknown, grown by
doubling with a copy. Each layer's keys and values are F16 tensors [capacity, kv_heads*head_dim] (one row per
position) in an anonymous mapping: zero until written, and backed by RAM only as positions are written.

Inside a graph a cache appears as a `GraphKV`: its `update_and_fetch` writes this step's rows with ggml_set_rows at
the positions held by an input tensor, and returns views of the first `span` cells (a multiple of SPAN_STEP). The
step's mask hides every cell beyond each row's position, so the same graph serves every decode step until the
request's length crosses into the next span.
"""

from __future__ import annotations

import ctypes

from shards.engines.backend import KVCache, RequestCache
from shards.engines.ggml.backend import expect
from shards.engines.ggml.lib import F16, Context, MappedBuffer, g

SPAN_STEP = 256  # cells attended are rounded up to this (llama.cpp pads its KV view the same way)


def span_for(length: int, capacity: int) -> int:
    return min(capacity, -(-length // SPAN_STEP) * SPAN_STEP)


class LayerKV:
    """One layer's keys and values for one request."""

    def __init__(self, n_kv_heads: int, head_dim: int, capacity: int):
        self.n_kv_heads, self.head_dim, self.capacity = n_kv_heads, head_dim, capacity
        self.row = n_kv_heads * head_dim * 2  # bytes of one position's keys (F16)
        half = -(-capacity * self.row // 64) * 64
        self.ctx = Context(2)
        self.k = self.ctx.new(F16, (n_kv_heads * head_dim, capacity))
        self.v = self.ctx.new(F16, (n_kv_heads * head_dim, capacity))
        try:
            self.mem = MappedBuffer(2 * half)
            self.mem.place(self.k, 0)
            self.mem.place(self.v, half)
        except BaseException:
            self.ctx.free()
            raise
        self.nbytes = 2 * capacity * self.row

    def copy_from(self, old: LayerKV, positions: int) -> None:
        n = positions * self.row  # rows are positions: the first `positions` rows are one contiguous block
        ctypes.memmove(self.k.contents.data, old.k.contents.data, n)
        ctypes.memmove(self.v.contents.data, old.v.contents.data, n)

    def free(self) -> None:
        self.mem.free()
        self.ctx.free()


class RequestKV(RequestCache):
    """Every layer's cache of one request, how many positions they hold (advanced by `commit` only) and how many
    they can hold."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int):
        super().__init__([])
        self.capacity = capacity
        try:
            for _ in range(n_layers):
                self.layers.append(LayerKV(n_kv_heads, head_dim, capacity))
        except BaseException:
            self.free()
            raise

    def grow(self, capacity: int) -> None:
        """Move to larger caches (the graphs that referenced the old ones must be dropped by the caller)."""
        grown = []
        try:
            for old in self.layers:
                new = LayerKV(old.n_kv_heads, old.head_dim, capacity)
                grown.append(new)
                new.copy_from(old, self.length)
        except BaseException:
            for layer in grown:
                layer.free()
            raise
        for old in self.layers:
            old.free()
        self.layers, self.capacity = grown, capacity

    def free(self) -> None:
        for layer in self.layers:
            layer.free()
        self.layers = []


class GraphKV(KVCache):
    """A layer cache as the graph being built sees it (see the module docstring)."""

    def __init__(self, ops, layer: LayerKV, positions, span: int):
        self.ops, self.layer, self.positions, self.span = ops, layer, positions, span

    def update_and_fetch(self, k, v, start):
        ops, layer = self.ops, self.layer
        t, width = k.shape[0], layer.n_kv_heads * layer.head_dim
        k_rows, v_rows = ops.reshape(k, (t, width)), ops.reshape(v, (t, width))
        expect(self.positions.shape == (t,) and k_rows.strides[-1] == v_rows.strides[-1] == 4, f"kv rows {k.shape}")
        # set_rows returns a view of the cache that depends on the write: reading through it orders the read after it
        k_all = ops.wrap(ops.node(g.ggml_set_rows, layer.k, k_rows.t, self.positions.t), (layer.capacity, width))
        v_all = ops.wrap(ops.node(g.ggml_set_rows, layer.v, v_rows.t, self.positions.t), (layer.capacity, width))
        shape = (layer.n_kv_heads, self.span, layer.head_dim)
        strides = (layer.head_dim * 2, layer.row, 2)
        return ops.view(k_all, shape, strides), ops.view(v_all, shape, strides)

    @property
    def nbytes(self) -> int:
        return self.layer.nbytes
