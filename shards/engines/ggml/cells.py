"""KV cells of the ggml engine: every request's keys and values in one pair of F16 tensors per layer (llama.cpp's
unified KV cache), each request owning a contiguous range of cells.

Per layer one K tensor [cells, kv_heads*head_dim] (a cell is one position of one request: its keys contiguous) and
the values in the layouts the backend's attentions read (attention.gemm_from when the pool is made): transposed,
[kv_heads*head_dim, cells] (one value element's cells contiguous: llama.cpp's layout without flash attention), for
rows attending by matmuls, which multiply a span of values as they lie (GgmlBackend.gemm_attention); as the keys are,
the rows ggml_flash_attn_ext reads, for rows attending by flash attention. A pool for both kernels keeps both: the
rows below `gemm_from` write their values as rows, the rows past it in lines; a matmul row attends the positions
below too, so the first time a request has one, its rows below are copied into lines (`lines_from_rows`, once per
request: a range's `lines_valid` says how far its lines hold), and a step whose flash rows precede matmul rows of
the same request writes them in both. Either way no step transposes the values. All in one anonymous mapping: zero until
written and backed by RAM only where written (transposed values a page of every element's line at a time); freed
cells go back to the kernel (MADV_DONTNEED, read as zeros again) a page of every line at a time at least (a large
range as it ends, small ones once the pool's free tail holds that much), and any cell left holds a finite value
(graph.py clamps what it writes).
A request's range holds what it has now (at least 256 cells), taken first fit from the low end (the engine's
starting on CELL_ALIGN cells) so the cells in use stay packed and the spans a step attends stay small, and moves to a
range twice as large when it outgrows it, up to its reservation (StepInput.max_positions). When no free range is
large enough the pool doubles (its tensors move: `generation` says so, and every graph built on the old ones goes).

Cell 0 belongs to no request: rows that only pad a step to its graph's size (shards/engines/ggml/graph.py) write
there, and no request's row ever attends it.

Because the graphs attend through a mask, not through per-request tensors, a step's graph depends only on its
shape (rows, its groups' spans of cells, output), never on which requests it carries. A `CellRange` is the engine's
RequestCache: length, commit and truncate as every engine's, nbytes its range, free gives the range back.
"""

from __future__ import annotations

import ctypes
import mmap
from types import EllipsisType

import numpy as np

from shards.engines.backend import RequestCache
from shards.engines.ggml import attention
from shards.engines.ggml.host_memory import MappedBuffer
from shards.engines.ggml.lib import F16, Context, Tensor

SCRATCH_CELL = 0  # where padding rows write; in no request's range
CELL_ALIGN = 64  # the engine's ranges start on multiples of this: a row's sums fall in the same SIMD blocks wherever
# its range lies (GgmlBackend.gemm_attention)
PAGE = mmap.PAGESIZE
GIVE_BACK_CELLS = PAGE // 2  # freed cells go back to the kernel this many at a time at least: a page of every line


class CellPool:
    """Every layer's K and V cells, and which ranges of cells are free (sorted, disjoint, merged [start, end))."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        cells: int,
        align: int = 1,
        gemm_from: int | None | EllipsisType = ...,
    ):
        """`gemm_from`: the first position attended by matmuls (None: none, 0: all), attention.gemm_from() unless
        given."""
        if n_layers < 1 or n_kv_heads < 1 or head_dim < 1 or cells < 2 or align < 1:
            raise ValueError(f"a cell pool needs layers, heads, head_dim >= 1 and >= 2 cells, got {cells} cells")
        self.gemm_from = attention.gemm_from() if gemm_from is ... else gemm_from
        if self.gemm_from is not None and self.gemm_from < 0:
            raise ValueError(f"gemm_from is a position >= 0 or None, not {self.gemm_from}")
        self.n_layers, self.width, self.align = n_layers, n_kv_heads * head_dim, align
        self.transposed = self.gemm_from is not None  # values kept in lines (for matmul attention)
        self.value_rows = self.gemm_from != 0  # values kept as rows (for flash attention)
        self.row = self.width * 2  # bytes of one cell of one tensor (F16)
        self.position_bytes = 2 * n_layers * self.row  # what one cell costs across K and V of every layer
        self.generation = 0
        self.copied = 0  # cells copied so far (ranges moved, the pool grown), per tensor: tests bound it
        self.ctx, self.mem = None, None
        self._map(cells)
        self.free_ranges: list[tuple[int, int]] = [(SCRATCH_CELL + 1, cells)]
        self.clean_from = SCRATCH_CELL + 1  # every cell from here on is free and given back (or never touched)
        self.lines_end = 0  # one past the last cell whose lines may hold a value: the pool's growth copies no further

    def extra_bytes(self, positions: int) -> int:
        """Memory a request of `positions` positions takes beyond `position_bytes` each: its values kept twice."""
        both = self.transposed and self.value_rows
        return min(positions, self.gemm_from) * self.n_layers * self.row if both else 0

    def _map(self, cells: int) -> None:
        """Tensors of `cells` cells, each starting on a page (so a range's pages can be given back per tensor): per
        layer K, then V as rows and V as lines, whichever the pool keeps."""
        stride = -(-cells * self.row // PAGE) * PAGE
        per_layer = 1 + self.value_rows + self.transposed
        ctx = Context(per_layer * self.n_layers)
        try:
            mem = self._buffer(per_layer * self.n_layers * stride)
        except BaseException:
            ctx.free()
            raise
        try:
            k, v, lines, offsets = [], [], [], {}
            for _ in range(self.n_layers):
                for kind in [k] + [v] * self.value_rows + [lines] * self.transposed:
                    shape = (cells, self.width) if kind is lines else (self.width, cells)  # ne, innermost first
                    t = ctx.new(F16, shape)
                    offsets[id(t)] = len(offsets) * stride
                    mem.place(t, offsets[id(t)])
                    kind.append(t)
        except BaseException:
            mem.free()
            ctx.free()
            raise
        self.cells, self.stride, self.ctx, self.mem = cells, stride, ctx, mem
        self.k: list[Tensor] = k
        self.v: list[Tensor] = v  # values as rows (empty when the pool keeps none)
        self.v_lines: list[Tensor] = lines  # values transposed (empty when the pool keeps none)
        self.offsets = offsets  # each tensor's place in the mapping, by id

    def _buffer(self, size: int) -> MappedBuffer:
        """The memory the tensors go in (a device pool's is the device's: shards/engines/ggml/on_device.py)."""
        return MappedBuffer(size)

    @property
    def used_end(self) -> int:
        """One past the highest cell any range holds (the pool's tail beyond it is free)."""
        last = self.free_ranges[-1] if self.free_ranges else None
        return last[0] if last and last[1] == self.cells else self.cells

    def allocate(self, n: int) -> int:
        """The first cell of a free range of n cells starting on a multiple of `align`, the lowest that fits; the
        pool doubles when none does."""
        if n < 1:
            raise ValueError(f"a cell range holds at least one cell, not {n}")
        while True:
            for i, (start, end) in enumerate(self.free_ranges):
                at = -(-start // self.align) * self.align
                if end - at >= n:
                    self.free_ranges[i : i + 1] = [r for r in ((start, at), (at + n, end)) if r[1] > r[0]]
                    self.clean_from = max(self.clean_from, at + n)
                    return at
            self.grow(max(2 * self.cells, -(-self.used_end // self.align) * self.align + n))

    def release(self, start: int, n: int) -> None:
        """Give cells [start, start+n) back, merged with free neighbours; memory goes back to the kernel in steps
        of at least GIVE_BACK_CELLS (`_discard`)."""
        end = start + n
        if self.mem is None:  # the pool itself is gone (its engine closed): nothing is left to give back
            return
        if start <= SCRATCH_CELL or end > self.cells or n < 1:
            raise ValueError(f"cells [{start}, {end}) are not a range of this pool of {self.cells}")
        ranges, at = self.free_ranges, 0
        while at < len(ranges) and ranges[at][0] < start:
            at += 1
        if (at and ranges[at - 1][1] > start) or (at < len(ranges) and ranges[at][0] < end):
            raise ValueError(f"cells [{start}, {end}) are already free")
        lo, hi = start, end
        if at < len(ranges) and ranges[at][0] == end:
            end = ranges.pop(at)[1]
        if at and ranges[at - 1][1] == start:
            at -= 1
            start = ranges.pop(at)[0]
        ranges.insert(at, (start, end))
        if end == self.cells:  # the free tail: what it holds still, once that is a step's worth
            if self.clean_from - start >= GIVE_BACK_CELLS:
                self._discard(start, self.clean_from, start, end)
                self.clean_from = start
                self.lines_end = min(self.lines_end, start)
        elif n >= GIVE_BACK_CELLS:  # a hole: what a large range held (small holes are taken again soon)
            self._discard(lo, hi, start, end)

    def _discard(self, lo: int, hi: int, start: int, end: int) -> None:
        """Return the pages of every tensor that hold a cell of [lo, hi) and only cells of the free range [start,
        end) to the kernel (they read as zeros after): one span per tensor of cells, one per element's line of
        transposed values.

        Why in steps of GIVE_BACK_CELLS: a line's page holds 2,048 cells, so a range of a few hundred cells touches
        a page of every line of every layer (thousands), and giving them back each time a request ended, to fault
        them in again for the next one (ranges are taken from the low end), cost more than the step it followed."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        spans = [(self.offsets[id(t)], self.row) for t in self.k + self.v]
        if self.transposed:
            spans += [(self.offsets[id(t)] + e * self.cells * 2, 2) for t in self.v_lines for e in range(self.width)]
        for base, size in spans:
            first = max(-(-(base + start * size) // PAGE), (base + lo * size) // PAGE) * PAGE
            last = min((base + end * size) // PAGE, -(-(base + hi * size) // PAGE)) * PAGE
            if last > first:
                self.mem.map.madvise(mmap.MADV_DONTNEED, first, last - first)

    def values(self, layer: int) -> np.ndarray:
        """A layer's values as F16 [kv_heads*head_dim, cells], a view of the pool's memory (valid until it moves):
        the lines where the pool keeps them (every position's), else the rows transposed."""
        if self.transposed:
            return tensor_array(self.v_lines[layer], (self.width, self.cells))
        return tensor_array(self.v[layer], (self.cells, self.width)).T

    def wrote_lines(self, end: int) -> None:
        """The lines of cells below `end` may hold values now (a step wrote them, or a caller through `values`)."""
        self.lines_end = max(self.lines_end, end)

    def lines_from_rows(self, start: int, n: int) -> None:
        """Cells [start, start+n)'s values, as rows, copied into lines (for matmul rows attending them)."""
        if n > 0:
            for layer in range(self.n_layers):
                self.values(layer)[:, start : start + n] = self.value_rows_of(layer)[start : start + n].T
            self.wrote_lines(start + n)

    def value_rows_of(self, layer: int) -> np.ndarray:
        """A layer's values as rows, F16 [cells, kv_heads*head_dim] (a view), where the pool keeps them."""
        return tensor_array(self.v[layer], (self.cells, self.width))

    def copy(self, src: int, dst: int, n: int, lines: int | None = None) -> None:
        """Cells [src, src+n) to [dst, dst+n) in every tensor (ranges that do not overlap); of the transposed values
        only the first `lines` cells (all by default): a line's page holds 2,048 cells, so copying the lines of a
        few cells writes a page of every line of every layer, tens of MB for a 7B shard, however few they are."""
        lines = n if lines is None else max(0, min(lines, n))
        if n > 0:
            self.copied += n
            for t in self.k + self.v:
                base = t.contents.data
                ctypes.memmove(base + dst * self.row, base + src * self.row, n * self.row)
            for layer in range(len(self.v_lines) if lines else 0):
                v = self.values(layer)
                v[:, dst : dst + lines] = v[:, src : src + lines]
            if lines:
                self.wrote_lines(dst + lines)

    def move(self, start: int, n: int, keep: int, new_n: int, lines: int | None = None) -> int:
        """A range of n cells (its first `keep` in use, the lines of its first `lines`) moved to a new range of new_n
        cells; its first cell."""
        new = self.allocate(new_n)  # may grow the pool: the old range's cells move with it, same indices
        self.copy(start, new, keep, lines)
        self.release(start, n)
        return new

    def grow(self, cells: int) -> None:
        """Move every tensor into a mapping of `cells` cells (the cells in use copied, at the same indices; their
        lines only as far as any were written: a page of every line of every layer otherwise). Each old tensor's
        pages go back as soon as it is copied, so the move holds the cells in use once and one tensor twice, not
        every layer twice."""
        old_ctx, old_mem, old_rows, old_lines = self.ctx, self.mem, self.k + self.v, self.v_lines
        old_offsets, old_stride = self.offsets, self.stride
        used, old_cells = self.used_end, self.cells
        lines = min(used, self.lines_end)
        self._map(cells)
        self.copied += used

        def copied(src: Tensor) -> None:
            if hasattr(mmap, "MADV_DONTNEED"):
                old_mem.map.madvise(mmap.MADV_DONTNEED, old_offsets[id(src)], old_stride)

        for src, dst in zip(old_rows, self.k + self.v):
            ctypes.memmove(dst.contents.data, src.contents.data, used * self.row)
            copied(src)
        for layer, src in enumerate(old_lines if lines else ()):
            self.values(layer)[:, :lines] = tensor_array(src, (self.width, old_cells))[:, :lines]
            copied(src)
        self._grown(old_ctx, old_mem, old_cells, cells)
        self.clean_from = used  # the new mapping is untouched past the cells copied

    def _grown(self, old_ctx, old_mem, old_cells: int, cells: int) -> None:
        """After a move into `cells` cells: the old mapping freed, the new cells [old_cells, cells) free."""
        old_mem.free()
        old_ctx.free()
        if self.free_ranges and self.free_ranges[-1][1] == old_cells:
            self.free_ranges[-1] = (self.free_ranges[-1][0], cells)
        else:
            self.free_ranges.append((old_cells, cells))
        self.generation += 1

    def free(self) -> None:
        if self.mem is not None:
            self.mem.free()
            self.ctx.free()
            self.mem = self.ctx = None


class CellRange(RequestCache):
    """One request's cells [start, start+capacity) in every layer of a pool; `length` of them hold its positions
    (position p in cell start+p)."""

    def __init__(self, pool: CellPool, capacity: int):
        super().__init__([])
        self.start = pool.allocate(capacity)
        self.pool, self.capacity = pool, capacity
        self.limit = capacity  # the most cells it may grow to (its reservation, where the engine knows one)
        self.lines_valid = 0  # its first positions below the pool's gemm_from whose values the lines hold too
        self.lines_end = 0  # one past the last of its cells whose lines were written (copies skip the lines past it)

    def wrote_lines(self, end: int) -> None:
        """Its lines were written up to cell `end` (by a step, or copied from its rows)."""
        self.lines_end = max(self.lines_end, end)
        self.pool.wrote_lines(self.start + end)

    def grow(self, capacity: int) -> None:
        """Move to a range of `capacity` cells, keeping the positions held."""
        self.lines_end = min(self.lines_end, self.length)
        self.start = self.pool.move(self.start, self.capacity, self.length, capacity, self.lines_end)
        self.capacity = capacity

    @property
    def nbytes(self) -> int:
        pool = self.pool
        return self.capacity * pool.position_bytes + pool.extra_bytes(self.capacity) if pool is not None else 0

    def copy_span(self, start: int, end: int, room: int = 0) -> CellRange:
        """A new range of the pool holding a copy of this one's cells [start, end) as its first, with the same
        reservation. A prefix (start 0) gets the capacity a request that grew to `room` positions has (the
        engine's smallest range, engine.py MIN_CAPACITY, doubled), so its next steps needn't move it and attend the
        spans others do (256 cells at least, as a new request takes, whatever its reservation: ranges of one size lie
        at one stride); a retained branch only what it holds."""
        if not 0 <= start < end <= self.length:
            raise ValueError(f"cannot copy positions [{start}, {end}) of a cache of {self.length}")
        n, want = end - start, max(end - start, room)
        doubled = max(256, min(1 << (want - 1).bit_length(), max(self.limit, 256)))
        copy = CellRange(self.pool, max(want, doubled) if start == 0 else n)
        copy.limit = max(self.limit, copy.capacity)
        lines = min(max(self.lines_end - start, 0), n)
        self.pool.copy(self.start + start, copy.start, n, lines)  # after the allocation: a grown pool keeps the indices
        copy.commit(n)
        copy.lines_valid = min(max(self.lines_valid - start, 0), n)
        copy.lines_end = lines
        return copy

    def append_from(self, src: CellRange, n: int) -> None:
        """`src`'s first n cells after this range's positions (moved to a larger range if they don't fit). The lines
        hold values as far as both ranges' did without a gap."""
        if not 1 <= n <= src.length:
            raise ValueError(f"cannot append {n} positions of a cache of {src.length}")
        end = self.length + n
        if end > self.capacity:
            self.grow(end)
        lines = min(src.lines_end, n)
        self.pool.copy(src.start, self.start + self.length, n, lines)
        if lines:
            self.wrote_lines(self.length + lines)
        if self.lines_valid >= self.length:
            self.lines_valid = self.length + min(src.lines_valid, n)
        self.commit(n)
        self.limit = max(self.limit, self.capacity)

    def free(self) -> None:
        if self.pool is not None:
            self.pool.release(self.start, self.capacity)
            self.pool = None


def tensor_array(t: Tensor, shape: tuple[int, int]) -> np.ndarray:
    """An F16 tensor's memory as a numpy view of `shape` (numpy order); no copy, and no export of the mapping that
    holds it, so the mapping can still be closed (after which the view must not be used)."""
    n = shape[0] * shape[1]
    return np.ctypeslib.as_array((ctypes.c_uint16 * n).from_address(t.contents.data)).view(np.float16).reshape(shape)
