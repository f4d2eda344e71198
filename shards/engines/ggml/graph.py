"""Compute graphs of the ggml engine: one per step shape, built by running the shared model once, then re-run.

A `Shape` is all that fixes a graph: how many rows (padded, see `padded_rows`), how the rows attend (`Group`s of
consecutive rows, each over a range of cells of the engine's pool, shards/engines/ggml/cells.py) and which outputs
come out. Lone rows of requests whose ranges have one size and lie at one stride (decoding requests, in the order
of their ranges) form a strided group: one row per request, each over its own range only (shards/engines/ggml/
layout.py). Other decode rows (and short prompt chunks) form groups of neighbouring requests, each over the span of
its requests' ranges, so a row scans few cells that are not its own; either way a decode step's graph stays the
same while the same requests decode. A prompt chunk of 64 rows or more
forms a group over its own request's cells (a step with such chunks builds its graph, a few ms beside the chunk's
compute). Which requests a step carries, where their cells are and what each row may see are inputs: every row's
token (or hidden row), position and cell (where ggml_set_rows writes its keys and values), and per group an F16 mask
[rows, cells] that is 0 on the cells of the row's own request at or before its position and -inf everywhere else.
So a step attends once per group and layer and the graph has a few nodes per layer however many requests decode
in it.

Exactness, with either of the backend's attentions (a group's rows take the one their positions take: attention.py's
gemm_from). "flash", llama.cpp's kernel: ggml's CPU flash
attention, which skips every -inf cell outright, one row at a time (GgmlBackend.flash_attention): the online softmax
over exactly its own request's cells, in cell order. "gemm": two F16 matmuls and a softmax over the group's span
(GgmlBackend.gemm_attention), the values read where the pool keeps them, transposed (cells.py), each sum in one order
per element whatever else the step holds; the masked cells add exact zeros, so a row's result depends only on its
own request's cells, their order, and where they fall in SIMD blocks, which the pool's aligned ranges fix (cells.py):
the same numbers whichever other requests share the group, and wherever the request's range lies. Every cell is
finite (keys and values are clamped to F16's range as they are written; padding rows see one cell), since a row's
matmuls read every cell of its span, its neighbours' too.

The first step of a shape builds its graph (milliseconds of Python) and gives it its own compute buffer;
later steps copy the inputs and compute. Graphs are kept least recently used first out, at most `GraphCache.limit`.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from shards.engines.backend import KVCache
from shards.engines.ggml import picks
from shards.engines.ggml.arrays import GArray, ValueLines, expect
from shards.engines.ggml.attention import ATTENTION_ROWS, score_block
from shards.engines.ggml.backend import GgmlBackend
from shards.engines.ggml.cells import CellPool
from shards.engines.ggml.lib import F16, F32, I32, Context, GgmlError, cpu_buffer_type, g
from shards.engines.picks import Pick, Want, host_pick
from shards.model.transformer import ShardModel, Step

WINDOW_STEP = 256  # spans of cells start and end on multiples of this (llama.cpp pads its KV view to 256 too)
OUTPUTS = ("hidden", "last", "all")
PAD_FROM = 64  # steps of this many rows and more are padded to a multiple of 8 rows
F16_MAX = 65504.0  # the largest finite F16: what a cell's values are clamped to
SPARE_BYTES = 32 << 20  # compute buffers the cached graphs keep beside the newest one's (GraphCache)
SPARE_SHARE = 8  # a graph kept beside the newest holds at most 1/SPARE_SHARE of them: decode steps', not a chunk's


def padded_rows(n: int) -> int:
    """Rows a step of n rows runs with: n below PAD_FROM rows, else a multiple of 8 (at most 7 rows, 11%, of
    padding). A graph costs milliseconds of Python to build, so small steps keep their exact
    size rather than pay for padding rows in every matmul; large ones, mostly prompt chunks of any size, share a
    few shapes."""
    if n < 1:
        raise ValueError(f"a step has at least one row, not {n}")
    return n if n < PAD_FROM else -(-n // 8) * 8


@dataclass(frozen=True)
class Group:
    """Consecutive rows that attend together, over cells [lo, lo + cells) of the pool."""

    rows: int
    lo: int
    cells: int
    gemm: bool = False  # the rows attend by matmuls over values in lines (else by flash attention over rows)
    lines: bool = False  # flash rows that also write their values in lines: a later row of the step reads them
    stride: int = 0  # > 0: one row per request, row i attending cells [lo + i*stride, lo + i*stride + cells) only


@dataclass(frozen=True)
class Shape:
    rows: int  # padded rows
    groups: tuple[Group, ...]  # the rows, in order, by the cells they attend
    output: str  # "hidden" (not the last shard), "last" (chosen rows' logits) or "all" (every row's)
    outputs: int  # rows of logits for "last" (padded like rows), else 0
    picks: bool = False  # the graph also picks each logits row's greedy token (shards/engines/ggml/picks.py)
    best: bool = False  # ... and takes each logits row's best ids and values, for drawn rows (the same)

    def __post_init__(self):
        if self.rows < 1 or self.output not in OUTPUTS or sum(gr.rows for gr in self.groups) != self.rows:
            raise ValueError(f"bad graph shape {self}")
        if any(gr.rows < 1 or gr.lo < 0 or gr.cells < 1 for gr in self.groups):
            raise ValueError(f"bad attention groups {self.groups}")
        if any(gr.stride and (gr.rows < 2 or gr.gemm or gr.lines or gr.stride < gr.cells) for gr in self.groups):
            raise ValueError(f"a strided group is 2+ flash rows over disjoint ranges: {self.groups}")
        if (self.output == "last") != (self.outputs > 0) or (self.picks and self.output == "hidden"):
            raise ValueError(f"a graph has chosen logits rows when its output is 'last', picks with logits: {self}")
        if self.best and not self.picks:
            raise ValueError(f"a graph takes drawn rows' candidates beside its picks: {self}")


@dataclass(frozen=True)
class StepWork:
    """What a step costs, counted rather than timed (the same on a busy machine): the rows the graph computes
    (padded), the cells their attention scans (every cell of each row's group: the mask's elements, written each
    step, and what the row's matmuls compute over), the cells they attend (a row at position p: its request's p + 1
    cells, attention's own share), and whether the step built its graph."""

    rows: int
    scanned: int
    visible: int
    built: bool

    def __post_init__(self):
        if self.rows < 1 or not 0 < self.visible <= self.scanned:
            raise ValueError(f"bad step work {self}")

    @classmethod
    def of(cls, shape: Shape, p, built: bool) -> StepWork:
        """`p`: the step's Packing (shards/engines/step.py)."""
        visible = int(np.sum(p.positions, dtype=np.int64)) + int(p.bounds[-1])
        return cls(shape.rows, sum(gr.rows * gr.cells for gr in shape.groups), visible, built)


class PoolKV(KVCache):
    """One layer of the cell pool as the graph sees it: `update_and_fetch` writes the step's keys and values at
    the rows' cells (an input) and returns views of the group's span of cells, the values in the layout of the
    group's attention. `heads`: the layer's tensors as the step's earlier groups left them (each write returns a
    view that depends on it; the next group writes through that view), so a group reading cells another group of the
    step wrote (a request's rows on both sides of the pool's gemm_from) reads them after the write."""

    def __init__(self, ops: GgmlBackend, pool: CellPool, layer: int, cells: GArray, group: Group, heads: dict):
        self.ops, self.pool, self.layer, self.cells, self.group, self.heads = ops, pool, layer, cells, group, heads

    def update_and_fetch(self, k, v, start):
        ops, pool, heads, gr = self.ops, self.pool, self.heads, self.group
        t = k.shape[0]
        k_rows, v_rows = ops.reshape(k, (t, pool.width)), ops.reshape(v, (t, pool.width))
        expect(self.cells.shape == (t,) and k_rows.strides[-1] == v_rows.strides[-1] == 4, f"kv rows {k.shape}")
        expect(pool.transposed if gr.gemm else pool.value_rows, f"a pool without the values {gr} attends")
        # every cell finite (ggml's clamp takes NaN to the top too): a row's matmuls read every cell of its span,
        # its neighbours' included, where a non-finite value would make its own numbers NaN
        k_rows, v_rows = (ops.wrap(ops.node(g.ggml_clamp, x.t, -F16_MAX, F16_MAX), x.shape) for x in (k_rows, v_rows))
        # set_rows returns a view of the cells that depends on the write: reading through it orders the read after it
        heads["k"] = ops.node(g.ggml_set_rows, heads["k"], k_rows.t, self.cells.t)
        k_all = ops.wrap(heads["k"], (pool.cells, pool.width))
        heads_n, hd = k.shape[1], k.shape[2]
        at = gr.lo * pool.row
        if gr.stride:  # each row's own range: [rows, kv_heads, cells, hd], a request every `stride` cells
            shape, strides = (gr.rows, heads_n, gr.cells, hd), (gr.stride * pool.row, hd * 2, pool.row, 2)
            heads["v"] = ops.node(g.ggml_set_rows, heads.get("v", pool.v[self.layer]), v_rows.t, self.cells.t)
            v_all = ops.wrap(heads["v"], (pool.cells, pool.width))
            return ops.view(k_all, shape, strides, at), ops.view(v_all, shape, strides, at)
        keys = ops.view(k_all, (heads_n, gr.cells, hd), (hd * 2, pool.row, 2), at)
        if gr.gemm or gr.lines:
            # values transposed (cells.py): each of a row's elements is a one-element "row" of its element's line of
            # cells, written at the row's cell (set_rows broadcasts the cells over the elements)
            if "lines" not in heads:
                heads["lines"] = ops.view(
                    ops.wrap(pool.v_lines[self.layer], (pool.width, pool.cells)),
                    (pool.width, pool.cells, 1),
                    (pool.cells * 2, 2, 2),
                ).t
            v_elems = ops.view(v_rows, (pool.width, t, 1), (4, v_rows.strides[0], 4))
            heads["lines"] = ops.node(g.ggml_set_rows, heads["lines"], v_elems.t, self.cells.t)
            if gr.gemm:
                v_all = ops.wrap(heads["lines"], (pool.width, pool.cells, 1))
                lines = ops.view(v_all, (heads_n, hd, gr.cells), (hd * pool.cells * 2, pool.cells * 2, 2), gr.lo * 2)
                return keys, ValueLines(ops, lines.t, lines.shape)  # [kv_heads, hd, cells]
        heads["v"] = ops.node(g.ggml_set_rows, heads.get("v", pool.v[self.layer]), v_rows.t, self.cells.t)
        v_all = ops.wrap(heads["v"], (pool.cells, pool.width))
        return keys, ops.view(v_all, (heads_n, gr.cells, hd), (hd * 2, pool.row, 2), at)

    @property
    def nbytes(self) -> int:
        return self.group.cells * self.pool.row * 2


class Graph:
    """A step's graph over the pool's tensors. Inputs: `ints` (tokens on a first shard, then positions, then cells,
    each [rows]), hidden rows on other shards, the masks (one [rows, cells] per group, in one input) and, for
    'last', which rows give logits."""

    on_host = True  # its compute buffer is host memory (`host_output`); a device's graph is not

    def __init__(self, ops: GgmlBackend, model: ShardModel, shape: Shape, pool: CellPool, *, first: bool, hidden: int):
        rows, layers = shape.rows, len(model.layers)
        self.shape, self.first = shape, first
        heads = max((layer.self_attn.n_heads for layer in model.layers), default=1)
        blocks = sum(  # a group's rows attend in blocks: flash's, matmuls' (a group may straddle GEMM_FROM)
            -(-gr.rows // ATTENTION_ROWS) + -(-gr.rows // score_block(gr.cells, heads)) + 1 for gr in shape.groups
        )
        # ~40 tensors per layer (measured 38 for Qwen3 with q/k norms), 10 per attention block and 14 per group and
        # layer (cache writes and views, gemm attention), 8 per group, MoE ~20 + top-k
        n = len(shape.groups)
        self.ctx = Context(80 + 8 * n + layers * (96 + 10 * blocks + 14 * n), graph=True)
        ops.ctx = self.ctx
        try:
            n_ints = (3 if first else 2) * rows
            self.ints = ops.input(I32, (n_ints,))
            self.ints_np = np.zeros(n_ints, dtype=np.int32)
            at = rows if first else 0
            x = ops.view(self.ints, (rows,), (4,)) if first else ops.input(F32, (rows, hidden))
            self.hidden = None if first else x
            positions = ops.view(self.ints, (rows,), (4,), 4 * at)
            cells = ops.view(self.ints, (rows,), (4,), 4 * (at + rows))
            sizes = [gr.rows * gr.cells for gr in shape.groups]
            at_mask = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
            self.mask = ops.input(F16, (at_mask[-1],))
            mask_np = np.empty(at_mask[-1], dtype=np.float16)
            self.masks_np = [  # each group's mask [rows, cells]: views of the one input's host copy
                mask_np[a:b].reshape(gr.rows, gr.cells) for gr, a, b in zip(shape.groups, at_mask, at_mask[1:])
            ]
            self.mask_np = mask_np
            masks = [
                ops.view(self.mask, (gr.rows, gr.cells), (2 * gr.cells, 2), 2 * a)
                for gr, a in zip(shape.groups, at_mask)
            ]
            bounds = np.concatenate([[0], np.cumsum([gr.rows for gr in shape.groups])]).astype(int).tolist()
            self.out_ids = ops.input(I32, (shape.outputs,)) if shape.output == "last" else None
            self.out_ids_np = np.zeros(shape.outputs, dtype=np.int32)  # which rows give logits ("last")
            kv, heads = [], [{"k": pool.k[layer]} for layer in range(layers)]
            for gr, b in zip(shape.groups, bounds):
                rows_cells = ops.view(cells, (gr.rows,), (4,), 4 * b)
                kv.append([PoolKV(ops, pool, layer, rows_cells, gr, heads[layer]) for layer in range(layers)])
            step = Step(bounds, (0,) * len(shape.groups), positions, ops.rotary(positions), tuple(masks))
            out: GArray = ops.contiguous(model(x, step, kv, self.out_ids))
            self.picks = picks.tail(ops, out) if shape.picks else ()
            self.best = picks.best_tail(ops, out) if shape.best else ()
        except BaseException:  # a failed build (context full, a shape check): its context's memory goes back now
            self.ctx.free()
            raise
        finally:
            ops.ctx = None
        self.out, self.out_shape = out.t, out.shape
        # the host inputs a run uploads, with their addresses read once (each read builds a ctypes object)
        host = [(self.ints.t, self.ints_np), (self.mask.t, self.mask_np)]
        host += [(self.out_ids.t, self.out_ids_np)] if self.out_ids is not None else []
        self._uploads = [(t, a.ctypes.data, a.nbytes) for t, a in host]
        self._output: np.ndarray | None = None  # `host_output`
        self.gf = self.ctx.graph()
        for t in (
            out.t,
            *self.picks,
            *self.best,
        ):  # the logits stay an output beside picks: a row not picked is read from them
            g.ggml_set_output(t)
            g.ggml_build_forward_expand(self.gf, t)
        self.nodes = int(g.ggml_graph_n_nodes(self.gf))
        self.compute_bytes = self.allocate()

    def allocate(self) -> int:
        """One CPU compute buffer for every node, kept for the graph's re-runs; its size. (A graph on a device
        allocates through ggml's scheduler instead: shards/engines/ggml/on_device.py.)"""
        self.galloc = g.ggml_gallocr_new(cpu_buffer_type())
        if not self.galloc or not g.ggml_gallocr_alloc_graph(self.galloc, self.gf):
            self.free()
            raise MemoryError("ggml could not allocate the compute buffer of a graph")
        return int(g.ggml_gallocr_get_buffer_size(self.galloc, 0))

    def compute(self, backend: int) -> int:
        return g.ggml_backend_graph_compute(backend, self.gf)

    def run(self, backend: int, hidden: np.ndarray | None) -> np.ndarray:
        """Compute with `ints_np`, `mask_np` and `out_ids_np` as the caller filled them (ggml copies bytes and checks
        nothing: the caller checks every value), `hidden` float32 [rows, hidden] (C order) on a non-first shard."""
        self.run_inputs(backend, hidden)
        if self.on_host:  # copied from where the run left it (fresh: callers may keep outputs across steps)
            return self.host_output().copy()
        out = np.empty(self.out_shape, dtype=np.float32)
        g.ggml_backend_tensor_get(self.out, out.ctypes.data, 0, out.nbytes)
        return out

    def run_picks(
        self,
        backend: int,
        hidden: np.ndarray | None,
        wanted: list[Want],
        spans: list[tuple[int, int]],
    ) -> list[Pick]:
        """`run` with a pick for each request, over its logits rows [a, b) of `spans`: by the graph's tail where it
        has one (a device's), else on the host from the logits where the step left them (a CPU graph's buffer is
        host memory: copying a vocabulary per row out first costs more than the pick); only the rows that come back
        as logits are copied out of it."""
        self.run_inputs(backend, hidden)
        if self.picks:
            return picks.read(*self.picks, self.out, self.out_shape[-1], wanted, spans, self.best)
        logits = self.host_output()
        out = []
        for w, (a, b) in zip(wanted, spans):
            pick = host_pick(logits[a:b], w)
            out.append(pick if pick.tokens is not None else Pick(logits=pick.logits.copy()))
        return out

    def host_output(self) -> np.ndarray:
        """A CPU graph's output (hidden rows or logits) where its runs leave it, read after a run and before the
        next: a view made once, as the compute buffer is allocated once (`allocate`; nothing per step: right after a
        step every call not made since the last one costs tens of microseconds)."""
        if self._output is None:
            size, at = int(np.prod(self.out_shape)), self.out.contents.data
            self._output = np.ctypeslib.as_array((ctypes.c_float * size).from_address(at)).reshape(self.out_shape)
        return self._output

    def run_inputs(self, backend: int, hidden: np.ndarray | None) -> None:
        if hidden is not None:
            g.ggml_backend_tensor_set(self.hidden.t, hidden.ctypes.data, 0, hidden.nbytes)
        for t, at, size in self._uploads:
            g.ggml_backend_tensor_set(t, at, 0, size)
        status = self.compute(backend)
        if status != 0:
            raise GgmlError(f"ggml graph compute failed with status {status}")

    def copied_bytes(self) -> int:
        """What the graph's copies (ggml_cont, ggml_cpy) write per run: data moved beside the math, which must not
        grow with the cells attended (tests bound it)."""
        nodes = (g.ggml_graph_node(self.gf, i) for i in range(self.nodes))
        return sum(int(g.ggml_nbytes(t)) for t in nodes if g.ggml_op_name(t.contents.op) in (b"CONT", b"CPY"))

    def free(self) -> None:
        if self.galloc:
            g.ggml_gallocr_free(self.galloc)
            self.galloc = None
        self.ctx.free()


class GraphCache:
    """Built graphs by shape, least recently used dropped beyond `limit`; `builds` counts every graph built.

    Each graph keeps its own compute buffer for its re-runs, and a prompt chunk's is large (~130 MB for one 256-row
    chunk of a 7B-shaped shard) while its shape rarely comes again (its span moves with its position). Beside the
    newest graph the others keep at most `spare_bytes`, and none more than `spare_bytes // SPARE_SHARE` (a chunk's
    is dropped as soon as a step of another shape runs), the largest dropped first: the decode shapes' small graphs
    stay, and a node's memory does not grow with the prompts it has seen."""

    def __init__(self, limit: int = 16, spare_bytes: int = SPARE_BYTES):
        self.limit, self.spare_bytes = limit, spare_bytes
        self.graphs: OrderedDict[Shape, Graph] = OrderedDict()
        self.builds = 0

    def get(self, shape: Shape) -> Graph | None:
        graph = self.graphs.get(shape)
        if graph is not None and next(reversed(self.graphs)) != shape:  # a step of another shape ran last
            self.graphs.move_to_end(shape)
            self._spare(graph)
        return graph

    def put(self, graph: Graph) -> None:
        self.builds += 1
        self.graphs[graph.shape] = graph
        while len(self.graphs) > self.limit:
            self.graphs.popitem(last=False)[1].free()
        self._spare(graph)

    def _spare(self, newest: Graph) -> None:
        """Beside `newest`, drop the graphs over one spare's share, then the largest while over the spare."""
        others = [other for other in self.graphs.values() if other is not newest]
        for large in [other for other in others if other.compute_bytes > self.spare_bytes // SPARE_SHARE]:
            others.remove(large)
            self.graphs.pop(large.shape).free()
        while sum(other.compute_bytes for other in others) > self.spare_bytes:
            largest = max(others, key=lambda other: other.compute_bytes)
            others.remove(largest)
            self.graphs.pop(largest.shape).free()

    def clear(self) -> None:
        while self.graphs:
            self.graphs.popitem()[1].free()

    @property
    def compute_bytes(self) -> int:
        return sum(graph.compute_bytes for graph in self.graphs.values())
