"""A lone decode row's next step, set up from its last one: the same graph, three numbers and one mask cell.

One stream's decode step is one row, whose layout (shards/engines/ggml/layout.py) depends on its request's range of
cells, not on its position: step after step it is the same graph, and what changes in the graph's inputs is the
row's token, its position, its cell and one more visible cell in its mask row. Laying the step out again, finding
its graph and refilling every input (`GraphRunner.fill`: the whole mask reset, then the row's cells) costs more on
the host than the rest of the step's Python together, right after a step has pushed that code out of cache.

`LastRow` remembers a step that may go on this way, and `next` takes the step after it when it is exactly that:
the same request, its same range (start and capacity), the next position, a flash-attention position (below the
pool's gemm_from: matmul rows keep lines, which the full path tracks), the same output, on the CPU without window
masks, and no other step since (any step through the full path replaces what is remembered, so the graph's host
inputs hold the remembered row's values). The inputs it leaves are the ones `fill` would write (tests compare
logits bit for bit with the full path). `step_ahead` takes such a step before its token or hidden row is known (a
ring's node, while the input is on its way), and runs it once it is."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shards.engines.base import Engine, Packing, StepInput, check_input
from shards.engines.ggml.cells import CellRange
from shards.engines.ggml.graph import Graph, Shape
from shards.engines.ggml.layout import Segment
from shards.engines.picks import Want


@dataclass(frozen=True)
class LastRow:
    """The last step, a lone row that may go on: its graph, shape and segment, its request's range, its position
    and the step's kind (output and picks)."""

    graph: Graph
    shape: Shape
    segments: tuple[Segment, ...]
    request_id: str
    cache: CellRange
    start: int
    capacity: int
    position: int
    kind: tuple[bool, bool]

    def __post_init__(self):
        if len(self.segments) != 1 or self.shape.rows != 1 or self.position < 0:
            raise ValueError(f"a lone row's step has one segment of one row at a position >= 0, got {self}")

    @staticmethod
    def of(
        graph: Graph, shape: Shape, segments: list[Segment], p: Packing, caches: list[CellRange], kind, split
    ) -> LastRow | None:
        """What to remember of a step just laid out and filled; None where the next one can't follow it."""
        if len(caches) != 1 or shape.rows != 1 or len(segments) != 1 or shape.groups[0].gemm:
            return None
        s = int(p.starts[0])
        if split is not None and s + 1 >= split:
            return None
        c = caches[0]
        return LastRow(graph, shape, tuple(segments), p.request_ids[0], c, c.start, c.capacity, s, kind)

    def next(self, p: Packing, caches: list[CellRange], kind, split) -> LastRow | None:
        """This row's next step, if `p` is exactly that (see the module): remembered as the last."""
        if len(caches) != 1 or p.bounds[-1] != 1 or kind != self.kind or p.request_ids[0] != self.request_id:
            return None
        c, s = caches[0], int(p.starts[0])
        if c is not self.cache or c.start != self.start or c.capacity != self.capacity or s != self.position + 1:
            return None
        if (split is not None and s >= split) or not self.graph.galloc:  # (a graph the cache freed)
            return None
        return LastRow(self.graph, self.shape, self.segments, self.request_id, c, c.start, c.capacity, s, kind)

    def fill(self, x: np.ndarray, visible) -> None:
        """The graph's inputs for this step, from the last step's: what `GraphRunner.fill` would write."""
        graph, seg = self.graph, self.segments[0]
        gr = self.shape.groups[seg.group]
        ints, at = graph.ints_np, 0
        if graph.first:
            ints[0], at = x[0], 1
        ints[at], ints[at + 1] = self.position, self.start + self.position
        graph.masks_np[seg.group][seg.first, self.start - gr.lo - seg.first * gr.stride + self.position] = visible


def step_ahead(engine: Engine, batch: list[StepInput], wanted: list[Want] | None) -> Callable[[], list] | None:
    """The ggml engine's `Engine.ahead` (a GgmlEngine's), where the step is a lone row's next (`LastRow.next`): it
    is taken and filled now but for the row's token, which `go` sets; the runner remembers it, and the cache counts
    its position, only once `go` ran it. Until then the graph's inputs hold its position and cell, which no later
    step reads (this row's next step writes the same, a step laid out in full refills every input)."""
    e, runner = engine, engine.runner
    if len(batch) != 1 or batch[0].length != 1 or runner._row is None or e.pool.generation != runner.generation:
        return None
    item = batch[0]
    if item.request_id != runner._row.request_id or (wanted is not None and len(wanted) != 1) or not runner.next_rows:
        return None  # (checked before the cache is asked for: it would make one for a request it doesn't know)
    p = e.pack(batch)  # (its values checked again by `go`, once they came)
    caches = [e.request_cache(item, p.starts[0] + 1)]
    kind = (False, wanted is not None)
    row = runner._row.next(p, caches, kind, e.pool.gemm_from)
    if row is None:
        return None
    row.fill(np.zeros(1, dtype=np.int64), runner.masks.visible)
    first = e.shard.is_first

    def go() -> list:
        x = item.tokens if first else item.hidden
        check_input(e.config, first, x, f"request {item.request_id!r}")
        if first:
            row.graph.ints_np[0] = x[0]
        runner._row, runner._last = row, (row.shape, p, False)
        runner.next_row_steps += 1
        out = runner.computed_on(row.graph, row.shape, list(row.segments), x, p, caches, wanted)
        caches[0].commit(1)
        return out if wanted is not None else p.split(out, e.shard.is_last)

    return go
