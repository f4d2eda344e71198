"""The ggml engine: the shared Llama block computed by llama.cpp's ggml on weights kept in their GGUF block types.

A shard holds its weights as the file stores them (Q4_K, Q8_0, ...; a Hugging Face checkpoint, or a GGUF, (re)quantized
on load with `quantize`), so its memory is that of its tensors in the file, not 4 bytes per parameter. Matmuls are
ggml's quantized CPU kernels on up to `threads` threads: fewer while other processes keep cores busy (threads.py), since
ggml's threads wait for each other after every op.

Matmul weights of the types ggml's CPU_REPACK buffer has kernels for on this CPU (per llama.cpp's own probe), and whose
kernels give a row the same numbers alone and among others, or whose gemm does with the rows padded to fours
(repack_probe.py), are placed there; everything else, and always the embedding table, in plain CPU memory.

A step runs as every engine's does (`Engine.run`); this engine's runner, `GraphRunner`, gives each step shape (rows, the
spans of KV cells its groups of rows attend, output: graph.py) one compute graph, built by running the shared model on
the ggml backend the first time the shape is seen and re-run afterwards, whichever requests the step carries. KV caches
are F16 cells of one pool shared by every request, each owning a contiguous range (cells.py), and the step attends once
per layer and group of neighbouring requests, through a mask. Every input is validated before ggml sees it: a ggml
assertion would abort the process.

With `device` (a GPU's, devices.py) the same graphs run through ggml's backend scheduler with the weights and the cell
pool in the device's memory (on_device.py); without one, on the CPU.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from shards.engines.base import Engine, EngineInputError, Packing, StepInput
from shards.engines.ggml import attention, f16_probe
from shards.engines.ggml.arrays import expect
from shards.engines.ggml.backend import GgmlBackend
from shards.engines.ggml.cells import CELL_ALIGN, SCRATCH_CELL, CellPool, CellRange
from shards.engines.ggml.devices import Device, select
from shards.engines.ggml.gemm_rows import DEFAULT as FLOAT_MATMUL
from shards.engines.ggml.graph import Graph, GraphCache, Shape, StepWork
from shards.engines.ggml.host_memory import unmap_large_blocks
from shards.engines.ggml.layout import Segment, layout, lines_after, lines_before
from shards.engines.ggml.lib import default_threads, g
from shards.engines.ggml.next_row import LastRow, step_ahead
from shards.engines.ggml.on_device import DeviceGraph, DevicePool, OnDevice
from shards.engines.ggml.picks import has_top_k
from shards.engines.ggml.sliding import SlidingWindows
from shards.engines.ggml.threads import ThreadGovernor
from shards.engines.ggml.weights import QUANTIZE_CHOICES, load_ggml_shard_weights
from shards.engines.masks import CausalMasks
from shards.engines.picks import Draw, Pick, Want
from shards.engines.registry import ATTENTION_CHOICES, FLOAT_MATMUL_CHOICES
from shards.engines.runner import Runner
from shards.formats.config import ModelConfig
from shards.formats.gguf_model import rope_pairs_interleaved
from shards.formats.loader import open_model
from shards.formats.weights import ShardWeights
from shards.model.shard import Shard

log = logging.getLogger(__name__)
MIN_CAPACITY = 256  # a request without a reservation starts with this many positions and doubles
INITIAL_CELLS = 4096  # the cell pool's first size (virtual until written); it doubles when a range does not fit


def _attention_on(device: Device | None, attention: str | None) -> None:
    """--attention other than auto is the CPU's: a device attends by ggml's flash kernel throughout."""
    if device is not None and not device.is_cpu and attention not in (None, "auto"):
        raise ValueError(
            f"--attention {attention} applies to the CPU; on {device.name} attention is ggml's flash kernel "
            "throughout (leave --attention out, or add --device cpu)"
        )


class GgmlEngine(Engine):
    name = "ggml"
    options = ("threads", "quantize", "float_matmul", "device", "attention")  # node flags --threads, ...
    kv_value_bytes = 2  # F16 cache
    kv_values_twice = attention.GEMM_FROM  # under "auto" (a device pool keeps one layout: charged anyway)

    def __init__(
        self,
        model_dir: str | Path,
        shard: Shard,
        config: ModelConfig | None = None,
        threads: int | None = None,
        quantize: str | None = None,
        repack: bool = True,
        adapt_threads: bool = True,
        float_matmul: str | None = None,
        device: str | None = None,
        attention: str | None = None,
    ):
        self.check_options(model_dir, threads, quantize, float_matmul, attention=attention)
        unmap_large_blocks()  # before the load's slices and the graphs' buffers: what is freed leaves the process
        chosen = None if device is None else select(device)  # None: the CPU; a name or "auto": devices.py
        _attention_on(chosen, attention)
        self.on = None if chosen is None or chosen.is_cpu else OnDevice(chosen)
        f16_probe.warn_once(log)  # a ggml built for AVX512-FP16 arithmetic: how to rebuild it
        self.threads = default_threads() if threads is None else threads
        self.quantize, self.repack, self.adapt_threads = quantize, repack, adapt_threads
        self.float_matmul = float_matmul or FLOAT_MATMUL
        self.attention = attention  # None: the attention module's ATTENTION (auto)
        self.ops: GgmlBackend | None = None
        try:
            super().__init__(model_dir, shard, config)
        except BaseException:
            if self.ops is not None:
                self.ops.free()  # what the weights took, now rather than when collected
            if self.on is not None:
                self.on.free()
            raise

    def make_backend(self, model_dir: Path) -> GgmlBackend:
        # a llama GGUF's Q/K rows stay in llama.cpp's order, rotated as llama.cpp rotates them (ggml_weights.py)
        interleaved = open_model(model_dir).format == "gguf" and rope_pairs_interleaved(self.config)
        ops = GgmlBackend(self.config, self.shard.layer_count, self.repack, interleaved, float_matmul=self.float_matmul)
        return ops if self.on is None else self.on.hold_weights(ops)

    def load_weights(self, model_dir: Path) -> ShardWeights:
        """The shard's weights in their file's block types (or `quantize`'s), for ggml's kernels."""
        return load_ggml_shard_weights(model_dir, self.config, self.shard, self.quantize, self.threads)

    def make_runner(self) -> GraphRunner:
        """The CPU backend and the KV cell pool the step graphs run on, then the runner that builds them."""
        cfg, threads = self.config, self.threads
        self.ops.loaded()
        if self.ops.repacked:
            log.info(
                "ggml: matmul weights in CPU_REPACK (interleaved kernels): %s%s",
                ", ".join(f"{n} {t}" for t, n in sorted(self.ops.repacked.items())),
                f" ({len(self.ops.padded)} taking their rows in fours)" if self.ops.padded else "",
            )
        self._weights = {id(w): w for w in self.model.parameters()}  # tied embedding and head counted once
        self.backend = g.ggml_backend_cpu_init()
        if not self.backend:
            raise MemoryError("ggml could not start its CPU backend")
        g.ggml_backend_cpu_set_n_threads(self.backend, threads)
        if self.on is not None:
            self.on.cpu = self.backend  # the scheduler's fallback for ops the device lacks
        self.step_threads = threads  # what the backend is set to; the governor lowers it while others load the CPUs
        self.governor = ThreadGovernor(threads, adapt=self.adapt_threads)
        try:
            shape = (len(self.model.layers), cfg.n_kv_heads, cfg.head_dim, INITIAL_CELLS, CELL_ALIGN)
            if self.on is None:
                self.pool = CellPool(*shape, gemm_from=attention.gemm_from(self.attention))
            else:
                self.pool = DevicePool(self.on, *shape)
        except BaseException:
            g.ggml_backend_free(self.backend)
            self.backend = None
            raise
        return GraphRunner(self)

    @property
    def graphs(self) -> GraphCache:
        return self.runner.graphs

    @staticmethod
    def check_options(
        model_dir: str | Path,
        threads: int | None = None,
        quantize: str | None = None,
        float_matmul: str | None = None,
        device: str | None = None,
        attention: str | None = None,
    ) -> None:
        """Refuse bad options at start-up rather than when a shard first loads."""
        if attention is not None and attention not in ATTENTION_CHOICES:
            raise ValueError(f"--attention must be one of {', '.join(ATTENTION_CHOICES)}, got {attention!r}")
        if device is not None:  # a device the build lacks: refused, naming those present and how to build more
            _attention_on(select(device), attention)
        if float_matmul is not None and float_matmul not in FLOAT_MATMUL_CHOICES:
            raise ValueError(f"--float-matmul must be one of {', '.join(FLOAT_MATMUL_CHOICES)}, got {float_matmul!r}")
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ValueError(f"--threads must be a positive integer, got {threads!r}")
        if quantize is not None and quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")

    def nbytes(self) -> int:
        return sum(self.ops.nbytes(w) for w in self._weights.values())

    def picked(self, batch: list[StepInput], wanted: list[Want], all_logits: bool) -> list[Pick]:
        """`Engine.pick`, where the logits are: on a device by the step's graph's picking tail (ggml/picks.py), a
        drawn row's candidates too, on the CPU by numpy from the logits where the step left them (`Graph.run_picks`:
        faster than the tail's ggml ops, a scalar argmax and a broadcast subtraction); only rows not picked bring
        their logits back."""
        p = self.pack(batch)
        return self.computed(batch, p, lambda x, caches: self.runner.run(x, p, caches, all_logits, list(wanted)))

    @property
    def takes_best(self) -> bool:
        return self.runner.top_k

    def ahead(self, batch: list[StepInput], wanted: list[Want] | None) -> Callable[[], list] | None:
        """`Engine.ahead`: a lone decode row's step that follows the last one (ggml/next_row.py `step_ahead`)."""
        return step_ahead(self, batch, wanted)

    def close(self) -> None:
        """Free everything ggml holds for this engine (also done when it is garbage collected)."""
        if getattr(self, "backend", None):
            self.runner.graphs.clear()
            for rid in list(self.caches):
                self.caches.pop(rid).free()
            self.retained.clear()
            self.pool.free()
            g.ggml_backend_free(self.backend)
            self.backend = None
            self.ops.free()
            if self.on is not None:
                self.on.free()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the binding may already be gone, and the OS frees it all anyway
            pass


class GraphRunner(Runner):
    """Steps through graphs built once per step shape (shards/engines/ggml/graph.py) over the engine's cell pool
    (shards/engines/ggml/cells.py): each request's cells sized from its reservation, the step's rows, cells and
    mask set as inputs."""

    def __init__(self, engine: GgmlEngine):
        self.engine, self.config = engine, engine.config
        self.graphs = GraphCache()
        self.generation = engine.pool.generation
        self.masks = CausalMasks(np.float16(0), np.float16(-np.inf), np.float16)
        self.sliding = SlidingWindows.for_shard(engine.config, engine.shard)  # Gemma's window masks (ggml/sliding.py)
        self._last: tuple[Shape, Packing, bool] | None = None  # the last step: its shape, packing, whether built
        self._row: LastRow | None = None  # the last step, where it was a lone row that may go on (next_row.py)
        self.next_rows = True  # False: every step laid out and filled in full (tests compare the two)
        self.next_row_steps = 0  # steps taken from the last one (next_row.py)
        # drawn rows' candidates come from the graph's tail where the device has the kernel for it (ggml/picks.py)
        self.top_k = engine.on is not None and engine.shard.is_last and has_top_k(engine.on.dev, self.config.vocab_size)

    @property
    def last(self) -> StepWork | None:
        """What the last step cost, counted (tests, benchmarks): counted when asked, not on every step."""
        return None if self._last is None else StepWork.of(*self._last)

    def cache(self, cache: CellRange | None, item: StepInput, end: int) -> CellRange:
        """A range of what the request holds now (at least MIN_CAPACITY cells), doubled (moved) as it grows, up to
        its reservation when known. Not the whole reservation at once: a decode row scans its group's span of ranges
        (`layout`), and ranges sized by reservations made those scans several times what the requests hold
        (docs/benchmarks-log.md). A request whose prompt length is known (`item.prompt_positions`) takes at its
        first chunk the range its doubling would reach by its prompt's end: each move leaves the old range behind,
        a hole too small to go back to the kernel (cells.GIVE_BACK_CELLS), so a long prompt held its cells twice."""
        cfg = self.config  # the reservation comes with the request's first step (or a resumed one's)
        limit = max(end, min(item.max_positions or cfg.max_position_embeddings, cfg.max_position_embeddings))
        if cache is None:
            first = max(end, MIN_CAPACITY)
            if item.prompt_positions:  # a power of two, as MIN_CAPACITY doubled is
                first = max(end, 1 << (max(first, min(item.prompt_positions, limit)) - 1).bit_length())
            # a reservation below MIN_CAPACITY still gets MIN_CAPACITY cells (memory only where written): ranges of
            # one size, taken in order, lie at one stride, and lone rows there attend side by side (layout.py)
            cache = CellRange(self.engine.pool, min(first, max(limit, MIN_CAPACITY)))
            cache.limit = limit
        elif item.max_positions:
            cache.limit = limit
        if end > cache.capacity:
            cache.grow(max(end, min(2 * cache.capacity, cache.limit)))
        if end > cache.capacity:  # unreachable while validate() bounds positions; ggml would abort on it
            raise EngineInputError(f"request {item.request_id!r}: {end} positions exceed its cache of {cache.capacity}")
        return cache

    def shape(self, p: Packing, caches: list[CellRange], all_logits: bool) -> Shape:
        return self.layout(p, caches, all_logits)[0]

    def layout(self, p: Packing, caches: list[CellRange], all_logits: bool) -> tuple[Shape, list[Segment]]:
        e = self.engine
        output = "hidden" if not e.shard.is_last else ("all" if all_logits else "last")
        # strided groups on the CPU, and without window masks (layout.py)
        return layout(e.pool, output, p, caches, strided=e.on is None and self.sliding is None)

    def run(
        self, x: np.ndarray, p: Packing, caches: list[CellRange], all_logits: bool, picks: list[Want] | None = None
    ) -> np.ndarray | list[Pick]:
        """A step of lone rows runs in the order of its requests' ranges in the pool (neighbours in the pool attend
        as one strided group: layout.py), its output rows handed back in the step's order; a row's numbers don't
        depend on its place. With `picks` (a flag per request, last shard): a Pick per request (`GgmlEngine.pick`)."""
        n = len(caches)
        if n > 2 and p.bounds[-1] == n:
            order = sorted(range(n), key=[c.start for c in caches].__getitem__)
            if order != list(range(n)):
                ids, starts = tuple(p.request_ids[i] for i in order), [p.starts[i] for i in order]
                q = Packing(ids, [1] * n, starts, p.bounds)
                wanted = None if picks is None else [picks[i] for i in order]
                out = self.ordered(x[order], q, [caches[i] for i in order], all_logits, wanted)
                back = np.empty_like(out) if picks is None else [None] * n
                for i, o in enumerate(order):
                    back[o] = out[i]
                return back
        return self.ordered(x, p, caches, all_logits, picks)

    def ordered(
        self, x: np.ndarray, p: Packing, caches: list[CellRange], all_logits: bool, picks: list[Want] | None = None
    ) -> np.ndarray | list[Pick]:
        e, n = self.engine, len(caches)
        if e.pool.generation != self.generation:  # the pool moved (it grew): every graph points at the old tensors
            self.graphs.clear()
            self.generation = e.pool.generation
        if picks is not None:
            expect(not e.shard.is_last or len(picks) == n, f"picks for {len(picks)} of {n} requests")
        kind, split = (all_logits, picks is not None), e.pool.gemm_from
        row = self._row.next(p, caches, kind, split) if self._row is not None else None
        if row is not None:  # a lone decode row's next step (next_row.py)
            graph, shape, segments = row.graph, row.shape, list(row.segments)
            row.fill(x, self.masks.visible)
            self._last = (shape, p, False)
            self.next_row_steps += 1
        else:
            shape, segments = self.layout(p, caches, all_logits)
            if picks is not None:  # a device's graph picks in its tail; the CPU's picks on the host (Graph.run_picks)
                expect(shape.output != "hidden", f"picks for {len(picks)} of {n} requests")
                drawn = self.top_k and any(isinstance(w, Draw) for w in picks)
                shape = dataclasses.replace(shape, picks=e.on is not None, best=drawn)
            graph = self.graphs.get(shape)
            self._last = (shape, p, graph is None)
            if graph is None:
                model = e.model if self.sliding is None else self.sliding.builder(e.model, e.ops)
                new = Graph if e.on is None else partial(DeviceGraph, e.on)
                graph = new(e.ops, model, shape, e.pool, first=e.shard.is_first, hidden=self.config.hidden_size)
                if self.sliding is not None:
                    self.sliding.attach(graph, model)
                self.graphs.put(graph)
            self.fill(graph, x, p, caches, segments)
            if shape.output == "last":  # (a lone row's next step keeps them: the same rows give logits)
                graph.out_ids_np[n:] = 0
                graph.out_ids_np[:n] = np.asarray(p.bounds[1:], dtype=np.int32) - 1
            lines_before(self.engine.pool, shape, p, caches, segments)
            if self.sliding is not None:
                self.sliding.fill(graph, graph.masks_np)
            if e.on is None and self.sliding is None and self.next_rows:
                row = LastRow.of(graph, shape, segments, p, caches, kind, split)
        self._row = row
        return self.computed_on(graph, shape, segments, x, p, caches, picks)

    def computed_on(
        self, graph: Graph, shape: Shape, segments: list[Segment], x: np.ndarray, p: Packing, caches, picks
    ) -> np.ndarray | list[Pick]:
        """The step on its graph, laid out and filled (`ordered`, `next_row.step_ahead`): what `ordered` returns."""
        e, rows, n = self.engine, p.bounds[-1], len(caches)
        hidden = None
        if not e.shard.is_first and shape.rows == rows and x.dtype == np.float32 and x.flags.c_contiguous:
            hidden = x  # no padding rows: the step's own rows, as they are
        elif not e.shard.is_first:
            hidden = np.zeros((shape.rows, self.config.hidden_size), dtype=np.float32)
            hidden[:rows] = x
        threads = e.governor.threads()
        if threads != e.step_threads:
            g.ggml_backend_cpu_set_n_threads(e.backend, threads)
            e.step_threads = threads
        if picks is None:
            out = graph.run(e.backend, hidden)
        else:  # each request's rows of logits: its one in "last", its own in "all"
            bounds = range(n + 1) if shape.output == "last" else p.bounds
            out = graph.run_picks(e.backend, hidden, picks, list(zip(bounds, bounds[1:])))
        e.governor.ended()
        lines_after(shape, p, caches, segments)
        if picks is not None:
            return out
        return out[:n] if shape.output == "last" else out[:rows]

    def fill(self, graph: Graph, x: np.ndarray, p: Packing, caches: list[CellRange], segments: list[Segment]) -> None:
        """The step's rows into the graph's inputs: tokens, positions and cells (padding rows: token 0, position 0,
        the scratch cell), and each group's mask: -inf but for each row's own request's cells up to its position."""
        rows, padded = p.bounds[-1], graph.shape.rows
        ints = graph.ints_np
        at = 0
        if graph.first:
            ints[:rows], ints[rows:padded] = x, 0
            at = padded
        ints[at : at + rows], ints[at + rows : at + padded] = p.positions, 0
        starts = np.repeat(np.asarray([c.start for c in caches], dtype=np.int32), p.lengths)
        ints[at + padded : at + padded + rows] = starts + p.positions
        ints[at + padded + rows :] = SCRATCH_CELL
        graph.mask_np.fill(-np.inf)
        groups = graph.shape.groups
        for seg in segments:
            c, s = caches[seg.request], int(p.starts[seg.request]) + seg.offset
            gr = groups[seg.group]
            lo = c.start - gr.lo - seg.first * gr.stride  # a strided group's row: 0, its view is its own range
            graph.masks_np[seg.group][seg.first : seg.first + seg.rows, lo : lo + s + seg.rows] = self.masks(
                s, seg.rows, s + seg.rows
            )
        if padded > rows:  # padding rows see their group's first cell: a row seeing none is NaN, and so its cell
            graph.masks_np[-1][rows - padded :, 0] = 0
