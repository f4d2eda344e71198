"""How a step's rows attend, as groups of a graph's Shape (shards/engines/ggml/graph.py): which rows share a span
of cells, which requests' lone rows attend side by side at one stride, and where each request's rows went
(`Segment`s). The ggml engine's GraphRunner builds a graph per shape, so a layout that stays the same step after
step is a graph built once."""

from __future__ import annotations

from dataclasses import dataclass

from shards.engines.base import Packing
from shards.engines.ggml.cells import CellPool, CellRange
from shards.engines.ggml.graph import WINDOW_STEP, Group, Shape, padded_rows

OWN_GROUP_ROWS = 64  # a prompt chunk of this many rows attends its own cells (layout)
SPAN_CELLS = 1024  # shorter rows attend in groups of neighbouring requests whose ranges span at most this (layout)
STRIDED = True  # lone rows of requests whose ranges lie at one stride attend as one strided group (strided_runs)


@dataclass(frozen=True)
class Segment:
    """Rows [offset, offset + rows) of the step's request `request` are rows [first, first + rows) of group `group`."""

    request: int
    group: int
    first: int
    offset: int
    rows: int

    def __post_init__(self):
        if min(self.request, self.group, self.first, self.offset) < 0 or self.rows < 1:
            raise ValueError(f"bad segment {self}")


def layout(
    pool: CellPool, output: str, p: Packing, caches: list[CellRange], *, strided: bool
) -> tuple[Shape, list[Segment]]:
    """The step's shape, and where each request's rows went: its segments, each a run of its rows in one group.

    Decode rows and short prompt chunks, in the step's order, attend in groups of neighbours: a group grows
    while the span of its requests' ranges (WINDOW_STEP-aligned) stays within SPAN_CELLS, or the next range lies
    inside it. Why: a row's attention computes over every cell of its group's span (GgmlBackend.gemm_attention),
    and one group over all of a 16-row step's requests made each row scan every request's cells to attend its
    own. Ranges are taken first fit from the pool's low end as requests arrive, so
    requests decoded in arrival order are mostly neighbours. Spans follow the ranges' capacities, not the
    positions held, so a decode step's shape (and graph) stays the same step after step.

    A chunk of OWN_GROUP_ROWS rows or more attends its own request's cells only (256-cell bounds) and gets a
    graph built for the step (a cost beside its compute). A group's rows share one attention kernel, the one
    their positions take (the pool's gemm_from, attention.py), so a request whose rows cross it has two segments
    in two groups. Padding rows join the last shared group. `output`: the graph's ("hidden", "last" or "all").

    Lone flash rows of consecutive requests whose ranges have one capacity at one stride (`strided_runs`) form a
    strided group instead: each row attends its own range only, the requests side by side in one flash-attention
    op (attention.py's strided_attention), so no row scans its neighbours' masked cells and a layer writes and
    attends once for all of them (three span groups a layer at 8 rows before)."""
    cells, split = pool.cells, pool.gemm_from
    groups: list[list] = []  # [shared?, gemm?, rows, lo, hi, lines?, stride]
    segments: list[Segment] = []
    runs = strided_runs(p, caches, split) if strided and STRIDED else {}
    for i, (c, s, n) in enumerate(zip(caches, p.starts, p.lengths)):
        if i in runs:  # a request's lone flash row beside others' at the same stride: a strided group
            if runs[i] == 0:  # its first
                groups.append([False, False, 0, c.start, c.start + c.capacity, 0, caches[i + 1].start - c.start])
            groups[-1][2] += 1
            segments.append(Segment(i, len(groups) - 1, groups[-1][2] - 1, 0, 1))
            continue
        lo = c.start // WINDOW_STEP * WINDOW_STEP
        cut = n if split is None else min(max(split - s, 0), n)  # rows [0, cut) by flash, [cut, n) by matmuls
        for off, m, gemm in ((0, cut, False), (cut, n - cut, True)):
            if m == 0:
                continue
            if n >= OWN_GROUP_ROWS:
                groups.append(
                    [False, gemm, m, lo, min(cells, -(-(c.start + s + off + m) // WINDOW_STEP) * WINDOW_STEP), 0, 0]
                )
            else:
                hi = min(cells, -(-(c.start + c.capacity) // WINDOW_STEP) * WINDOW_STEP)
                last = groups[-1] if groups and groups[-1][0] and groups[-1][1] == gemm else None
                if last is not None and (
                    max(last[4], hi) - min(last[3], lo) <= SPAN_CELLS or last[3] <= lo and hi <= last[4]
                ):
                    last[2] += m
                    last[3], last[4] = min(last[3], lo), max(last[4], hi)
                else:
                    groups.append([True, gemm, m, lo, hi, 0, 0])
            if not gemm and cut < n:  # flash rows the request's matmul rows of this step attend
                groups[-1][5] = 1
            segments.append(Segment(i, len(groups) - 1, groups[-1][2] - m, off, m))
    rows = padded_rows(p.bounds[-1])
    if rows > p.bounds[-1]:
        if groups[-1][0]:
            groups[-1][2] += rows - p.bounds[-1]
        else:
            groups.append([True, split == 0, rows - p.bounds[-1], 0, min(cells, WINDOW_STEP), 0, 0])
    outputs = padded_rows(len(caches)) if output == "last" else 0
    shape = Shape(
        rows,
        tuple(Group(n, lo, hi - lo, gemm, bool(lines), stride) for _, gemm, n, lo, hi, lines, stride in groups),
        output,
        outputs,
    )
    return shape, segments


def strided_runs(p: Packing, caches: list[CellRange], split: int | None) -> dict[int, int]:
    """Request index -> its place in a run of 2+ consecutive requests that each bring one row attended by flash
    attention (a position below `split`, the pool's gemm_from), whose ranges have one capacity and lie at one
    stride (ranges taken in order, as decoding requests' are): each such run is a strided group (graph.py)."""
    runs: dict[int, int] = {}
    run: list[int] = []

    def close() -> None:
        if len(run) >= 2:
            runs.update((r, k) for k, r in enumerate(run))
        run.clear()

    for i, (c, s, n) in enumerate(zip(caches, p.starts, p.lengths)):
        if n != 1 or (split is not None and s >= split):
            close()
            continue
        if run:
            first, prev = caches[run[0]], caches[run[-1]]
            stride = c.start - prev.start
            if (
                c.capacity != first.capacity
                or stride < c.capacity
                or (len(run) >= 2 and stride != prev.start - caches[run[-2]].start)
            ):
                close()
        run.append(i)
    close()
    return runs


def lines_before(pool: CellPool, shape: Shape, p: Packing, caches: list[CellRange], segments: list[Segment]) -> None:
    """Before a step whose matmul rows attend a request's positions below the pool's gemm_from: those its flash
    rows wrote before this step, copied into lines where they aren't yet (once per request, cells.py)."""
    split = pool.gemm_from
    for seg in segments:
        if shape.groups[seg.group].gemm and split:
            c = caches[seg.request]
            upto = min(split, int(p.starts[seg.request]))  # the step's own flash rows write theirs in lines
            if c.lines_valid < upto:
                pool.lines_from_rows(c.start + c.lines_valid, upto - c.lines_valid)
                c.lines_valid = upto
                c.wrote_lines(upto)


def lines_after(shape: Shape, p: Packing, caches: list[CellRange], segments: list[Segment]) -> None:
    """How far each request's lines hold after the step: flash rows that wrote rows only end them at their first
    position (a rewrite, after a rollback, too); ones that wrote both extend them."""
    for seg in segments:
        gr = shape.groups[seg.group]
        c, a = caches[seg.request], int(p.starts[seg.request]) + seg.offset
        if gr.gemm or gr.lines:
            c.wrote_lines(a + seg.rows)
        if gr.gemm:
            continue
        if gr.lines and c.lines_valid >= a:
            c.lines_valid = max(c.lines_valid, a + seg.rows)
        else:
            c.lines_valid = min(c.lines_valid, a)
