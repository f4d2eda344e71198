"""Compute graphs of the ggml engine: built once per batch layout by running the shared model, then re-run.

A `Layout` is what fixes a graph's shape and the tensors it touches: which requests (their caches are baked in),
how many rows each brings, how many cache cells each attends (its span), and which logits come out. The first step
with a layout runs `ShardModel` on the ggml backend to build the graph (a few ms for a 30-layer model) and gives it
its own compute buffer; every later step with the same layout only copies in the inputs (tokens or hidden rows,
positions, masks) and computes: tens of microseconds of Python per step. `GraphRunner` is the engine's runner for
`BlockEngine.run`: it makes and grows the caches, finds or builds the step's graph and runs it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from shards.engines.ggml.backend import ATTENTION_ROWS, GArray, GgmlBackend
from shards.engines.ggml.cache import GraphKV, RequestKV
from shards.engines.ggml.lib import F16, F32, I32, Context, GgmlError, cpu_buffer_type, g
from shards.transformer import ShardModel, Step


@dataclass(frozen=True)
class Layout:
    request_ids: tuple[str, ...]
    lengths: tuple[int, ...]  # rows per request
    spans: tuple[int, ...]  # cache cells each request attends
    output: str  # "hidden" (not the last shard), "last" (each request's last row's logits) or "all" (every row's)

    @property
    def rows(self) -> int:
        return sum(self.lengths)


class Graph:
    def __init__(
        self,
        ops: GgmlBackend,
        model: ShardModel,
        layout: Layout,
        caches: list[RequestKV],
        first: bool,
        hidden_size: int,
    ):
        n, rows, layers = len(layout.lengths), layout.rows, len(model.layers)
        self.layout = layout
        # Room for every tensor the build creates: ~40 per layer plus ~12 per request and layer (measured 38 + 11n
        # for Qwen3 with q/k norms and biases-free fused weights), with margin; overflowing raises before ggml would.
        # Attention in blocks of ATTENTION_ROWS query rows (backend.py): ~6 more tensors per block and layer.
        blocks = sum(-(-t // ATTENTION_ROWS) for t in layout.lengths)
        self.ctx = Context(64 + layers * (96 + 16 * n + 6 * blocks) + 8 * n, graph=True)  # MoE: ~20 + top-k more
        ops.ctx = self.ctx
        try:
            # Few inputs, so a step makes few copies: token ids and positions share one I32 tensor, every
            # request's mask lives in one F16 tensor; the graph reads views of them.
            self.first = first
            self.ints = ops.input(I32, (2 * rows if first else rows,))
            self.ints_np = np.empty(2 * rows if first else rows, dtype=np.int32)
            x = ops.view(self.ints, (rows,), (4,)) if first else ops.input(F32, (rows, hidden_size))
            self.hidden = None if first else x
            positions = ops.view(self.ints, (rows,), (4,), 4 * rows if first else 0)
            sizes = [t * span for t, span in zip(layout.lengths, layout.spans)]
            self.mask_at = np.concatenate([[0], np.cumsum(sizes)]).tolist()
            self.mask = ops.input(F16, (self.mask_at[-1],))
            self.mask_np = np.empty(self.mask_at[-1], dtype=np.float16)
            masks = [
                ops.view(self.mask, (t, span), (2 * span, 2), 2 * at)
                for t, span, at in zip(layout.lengths, layout.spans, self.mask_at)
            ]
            bounds = np.concatenate([[0], np.cumsum(layout.lengths)]).tolist()
            out_ids = ops.input(I32, (n,)) if layout.output == "last" else None
            bound = []
            for r, cache in enumerate(caches):
                pos = ops.view(positions, (layout.lengths[r],), (4,), 4 * bounds[r])
                bound.append([GraphKV(ops, layer, pos, layout.spans[r]) for layer in cache.layers])
            step = Step(bounds, [c.length for c in caches], positions, ops.rotary(positions), masks)
            out: GArray = ops.contiguous(model(x, step, bound, out_ids))
        except BaseException:  # a failed build (context full, a shape check): its context's memory goes back now
            self.ctx.free()
            raise
        finally:
            ops.ctx = None
        g.ggml_set_output(out.t)
        self.out, self.out_shape = out.t, out.shape
        self.gf = self.ctx.graph()
        g.ggml_build_forward_expand(self.gf, out.t)
        self.galloc = g.ggml_gallocr_new(cpu_buffer_type())
        if not self.galloc or not g.ggml_gallocr_alloc_graph(self.galloc, self.gf):
            self.free()
            raise MemoryError("ggml could not allocate the compute buffer of a graph")
        self.compute_bytes = int(g.ggml_gallocr_get_buffer_size(self.galloc, 0))
        if out_ids is not None:  # fixed by the layout: set once, kept (inputs are never overwritten)
            last = np.asarray(bounds[1:], dtype=np.int32) - 1
            g.ggml_backend_tensor_set(out_ids.t, last.ctypes.data, 0, last.nbytes)

    def run(self, backend: int, x: np.ndarray, positions: np.ndarray, masks: list[np.ndarray]) -> np.ndarray:
        """Set the inputs and compute. x: token ids (any int dtype; checked by the engine) or float32 hidden rows;
        positions and masks exactly as the layout says (ggml copies bytes and checks nothing)."""
        ints, mask, at = self.ints_np, self.mask_np, self.mask_at
        if self.first:
            rows = len(x)
            ints[:rows], ints[rows:] = x, positions
        else:
            ints[:] = positions
            g.ggml_backend_tensor_set(self.hidden.t, x.ctypes.data, 0, x.nbytes)
        for i, m in enumerate(masks):
            mask[at[i] : at[i + 1]] = m.reshape(-1)
        g.ggml_backend_tensor_set(self.ints.t, ints.ctypes.data, 0, ints.nbytes)
        g.ggml_backend_tensor_set(self.mask.t, mask.ctypes.data, 0, mask.nbytes)
        status = g.ggml_backend_graph_compute(backend, self.gf)
        if status != 0:
            raise GgmlError(f"ggml graph compute failed with status {status}")
        out = np.empty(self.out_shape, dtype=np.float32)  # fresh: callers may keep outputs across steps
        g.ggml_backend_tensor_get(self.out, out.ctypes.data, 0, out.nbytes)
        return out

    def free(self) -> None:
        if self.galloc:
            g.ggml_gallocr_free(self.galloc)
            self.galloc = None
        self.ctx.free()


class GraphCache:
    """Built graphs by layout, least recently used dropped beyond `limit`; graphs of a released (or grown) request
    are dropped at once, since they point at its caches."""

    def __init__(self, limit: int = 8):
        self.limit = limit
        self.graphs: OrderedDict[Layout, Graph] = OrderedDict()

    def get(self, layout: Layout) -> Graph | None:
        graph = self.graphs.get(layout)
        if graph is not None:
            self.graphs.move_to_end(layout)
        return graph

    def put(self, graph: Graph) -> None:
        self.graphs[graph.layout] = graph
        while len(self.graphs) > self.limit:
            self.graphs.popitem(last=False)[1].free()

    def drop(self, request_id: str) -> None:
        for layout in [lay for lay in self.graphs if request_id in lay.request_ids]:
            self.graphs.pop(layout).free()

    def clear(self) -> None:
        while self.graphs:
            self.graphs.popitem()[1].free()

    @property
    def compute_bytes(self) -> int:
        return sum(graph.compute_bytes for graph in self.graphs.values())
