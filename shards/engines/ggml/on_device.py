"""The ggml engine on a device other than the CPU (Vulkan, CUDA, Metal, HIP: shards/engines/ggml/devices.py).

What changes from the CPU path is where memory lives and who computes, never what a graph computes:

- Weights go into the device's buffers (`DeviceArena`, flagged as weights so ggml's scheduler runs each op where its
  weight is), never CPU_REPACK. The KV cells too (`DevicePool`: the pool's tensors in one device buffer, cleared to
  zeros; cells move by copies through the host, which only prefix copies and the pool's growth do).
- Each step graph is computed by ggml's backend scheduler (`DeviceGraph`), the device first, the CPU after it: an
  op the device has no kernel for runs on the CPU, its inputs copied over by the scheduler. Those ops are counted
  once per engine, in the log, so a slow device path says why. Inputs (tokens, positions, cells, masks, hidden
  rows) are set in host memory and copied over by the scheduler; the output is copied back once per step.

Each graph owns its scheduler and compute buffers (the CPU path's graphs own their allocator the same way), so a
graph re-run costs its copies and compute, no allocation.
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter

import numpy as np

from shards.engines.ggml.backend import GgmlBackend
from shards.engines.ggml.cells import CellPool
from shards.engines.ggml.devices import Device, _handle
from shards.engines.ggml.graph import Graph
from shards.engines.ggml.host_memory import PieceHook, WeightArena, set_pieces
from shards.engines.ggml.lib import GgmlError, Tensor, g

log = logging.getLogger(__name__)
VIEW_OPS = frozenset({"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"})  # no compute: not counted as fallbacks


def _alloc(buft: int, size: int, what: str) -> int:
    buf = g.ggml_backend_buft_alloc_buffer(buft, size)
    if not buf:
        raise MemoryError(f"the device could not allocate {size / 2**20:.0f} MiB for {what}")
    return buf


class OnDevice:
    """The device's backend and buffer type, beside the engine's CPU backend (`cpu`, the scheduler's fallback: set
    by the engine once it has started it)."""

    def __init__(self, device: Device):
        if device.is_cpu:
            raise ValueError("OnDevice is for a device other than the CPU (the CPU path needs no scheduler)")
        self.device, self.cpu = device, None
        dev = _handle(device.name)
        self.backend = g.ggml_backend_dev_init(dev, None)
        if not self.backend:
            raise RuntimeError(f"ggml could not start device {device.name} ({device.description})")
        self.dev, self.buft = dev, g.ggml_backend_dev_buffer_type(dev)
        self.max_alloc = int(g.ggml_backend_buft_get_max_size(self.buft))
        self.reported = False
        self.fallbacks: Counter[str] = Counter()  # ops the scheduler put on the CPU, in the first graph that had any
        self.host_weights = 0  # bytes of weights too large for the device's kernels, kept in host memory

    def hold_weights(self, ops: GgmlBackend) -> GgmlBackend:
        """`ops` placing every weight it loads from now on in the device's buffers (never CPU_REPACK), its matmuls
        as ggml's (a device has no tinyBLAS: ggml/quant_rows.py)."""
        ops.arena, ops.repack, ops.vec_dot_route = DeviceArena(self, ops.arena), False, False
        return ops

    def scheduler(self, graph_size: int) -> int:
        if self.cpu is None:
            raise GgmlError("the engine has not given its CPU backend to the device's scheduler yet")
        backends = (ctypes.c_void_p * 2)(self.backend, self.cpu)
        sched = g.ggml_backend_sched_new(backends, None, 2, graph_size, False, False)
        if not sched:
            raise MemoryError("ggml could not create a backend scheduler")
        return sched

    def count_fallbacks(self, sched: int, gf) -> Counter[str]:
        """The compute ops of an allocated graph that the scheduler assigned to the CPU, by op."""
        out: Counter[str] = Counter()
        for i in range(int(g.ggml_graph_n_nodes(gf))):
            node = g.ggml_graph_node(gf, i)
            op = g.ggml_op_desc(node).decode()
            if op not in VIEW_OPS and g.ggml_backend_sched_get_tensor_backend(sched, node) == self.cpu:
                out[op] += 1
        return out

    def report(self, sched: int, gf) -> None:
        """Log, once per engine, which ops of a step graph run on the CPU instead of the device (or that none do)."""
        if self.reported:
            return
        self.reported = True
        self.fallbacks = self.count_fallbacks(sched, gf)
        splits = int(g.ggml_backend_sched_get_n_splits(sched))
        if self.fallbacks:
            log.warning(
                "ggml: %s lacks kernels for %d ops of a step graph, run on the CPU instead (%s; %d splits)",
                self.device.name,
                sum(self.fallbacks.values()),
                ", ".join(f"{n} {op}" for op, n in self.fallbacks.most_common()),
                splits,
            )
        else:
            log.info("ggml: every op of the step graphs runs on %s (%d split)", self.device.name, splits)

    def free(self) -> None:
        if self.backend:
            g.ggml_backend_free(self.backend)
            self.backend = None


class DeviceArena:
    """Weights packed into device buffers of at most CHUNK bytes (and the device's largest allocation), each
    flagged as holding weights. `host` is the CPU arena the backend started with (its rope factors, placed before
    the device was known): freed with this one."""

    CHUNK = 256 << 20

    def __init__(self, on: OnDevice, host: WeightArena):
        self.on, self.host = on, host
        self.buffers: list[int] = []
        self.at = self.end = 0
        self.nbytes = host.nbytes
        self.align = int(g.ggml_backend_buft_get_alignment(on.buft))

    def place(
        self, tensor: Tensor, pieces: list[np.ndarray], before: PieceHook = None, after: PieceHook = None
    ) -> None:
        """WeightArena.place on the device (or in host memory where no kernel may address the weight)."""
        size = int(g.ggml_nbytes(tensor))
        if sum(p.nbytes for p in pieces) != size or not all(p.flags.c_contiguous for p in pieces):
            raise ValueError(f"weight data has {sum(p.nbytes for p in pieces)} bytes, ggml expects {size}")
        if not g.ggml_backend_dev_supports_op(self.on.dev, tensor):
            # larger than one kernel may address (Vulkan's storage buffer range: 128 MiB on lavapipe, e.g. a
            # 262k-token embedding table): in a device buffer the scheduler would abort the process; in host memory
            # the ops that read it run on the CPU, as llama.cpp places such a weight
            self.host.place(tensor, pieces, before, after)
            self.on.host_weights += size
            log.warning(
                "ggml: a weight of %.0f MiB is larger than %s's kernels address: kept in host memory, its ops on the CPU",
                size / 2**20,
                self.on.device.name,
            )
            return
        need = max(size, int(g.ggml_backend_buft_get_alloc_size(self.on.buft, tensor)))
        if need > self.on.max_alloc:
            raise MemoryError(f"a weight of {need} bytes exceeds {self.on.device.name}'s largest allocation")
        if self.at + need > self.end:
            chunk = min(max(self.CHUNK, need), self.on.max_alloc)
            buf = _alloc(self.on.buft, chunk, "weights")
            g.ggml_backend_buffer_set_usage(buf, g.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
            self.buffers.append(buf)
            self.at = int(g.ggml_backend_buffer_get_base(buf) or 0)
            self.end = self.at + chunk
        if g.ggml_backend_tensor_alloc(self.buffers[-1], tensor, self.at) != 0:
            raise GgmlError("ggml_backend_tensor_alloc failed")
        set_pieces(tensor, pieces, before, after)
        self.at += -(-need // self.align) * self.align
        self.nbytes += size

    def seal(self) -> None:
        self.host.seal()

    def place_repacked(self, tensor: Tensor, data: np.ndarray) -> None:
        raise GgmlError("CPU_REPACK is for CPU weights: a device engine places every weight with `place`")

    def free(self) -> None:
        for buf in self.buffers:
            g.ggml_backend_buffer_free(buf)
        self.buffers = []
        self.host.free()


class DeviceBuffer:
    """Device memory for a pool's tensors, placed and freed as a MappedBuffer is (the pool's `mem`): one buffer,
    or one per tensor where the whole exceeds the device's largest allocation. Cleared to zeros: cells never
    written read as zeros, as a fresh mapping's do."""

    def __init__(self, on: OnDevice, size: int):
        self.on, self.size = on, size
        self.buffers: list[int] = []
        self.whole = size <= on.max_alloc
        if self.whole:
            self._new(size)

    def _new(self, size: int) -> int:
        buf = _alloc(self.on.buft, size, "the KV cells")
        self.buffers.append(buf)
        g.ggml_backend_buffer_clear(buf, 0)
        return buf

    def place(self, tensor: Tensor, offset: int) -> None:
        size = int(g.ggml_nbytes(tensor))
        if offset + size > self.size:
            raise ValueError("tensor does not fit the device buffer")
        buf = self.buffers[0] if self.whole else self._new(size)
        at = int(g.ggml_backend_buffer_get_base(buf) or 0) + (offset if self.whole else 0)
        if g.ggml_backend_tensor_alloc(buf, tensor, at) != 0:
            raise GgmlError("ggml_backend_tensor_alloc failed")

    def free(self) -> None:
        for buf in self.buffers:
            g.ggml_backend_buffer_free(buf)
        self.buffers = []


class DevicePool(CellPool):
    """The engine's cell pool (shards/engines/ggml/cells.py) in one device buffer: the same tensors and ranges, in
    whatever layout the pool gives them, each cell found along the axis of the tensor that has `cells` entries.
    Cells move through the host (a prefix copy, the pool's growth: rare beside the steps); freed cells keep their
    (finite) values, masked off like any other request's."""

    def __init__(self, on: OnDevice, *args, **kwargs):
        self.on = on
        kwargs.setdefault("gemm_from", None)  # flash attention throughout: ggml's device kernels for it
        super().__init__(*args, **kwargs)

    def _buffer(self, size: int) -> DeviceBuffer:
        return DeviceBuffer(self.on, size)

    def _discard(self, lo: int, hi: int, start: int, end: int) -> None:
        pass  # device memory is not given back per page

    def values(self, layer: int) -> np.ndarray:
        raise GgmlError("a device pool's cells are in device memory: read them with ggml_backend_tensor_get")

    @staticmethod
    def _read(t: Tensor) -> np.ndarray:
        """An F16 tensor's values as uint16 in numpy order (2-D)."""
        out = np.empty((int(t.contents.ne[1]), int(t.contents.ne[0])), dtype=np.uint16)
        g.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
        return out

    @staticmethod
    def _write(t: Tensor, a: np.ndarray) -> None:
        g.ggml_backend_tensor_set(t, a.ctypes.data, 0, a.nbytes)

    @staticmethod
    def _by_cell(a: np.ndarray, cells: int) -> np.ndarray:
        """A view of `a` with its cells first."""
        return np.moveaxis(a, a.shape.index(cells), 0)

    def copy(self, src: int, dst: int, n: int, lines: int | None = None) -> None:
        """Cells of keys and values as rows (each cell's bytes contiguous) move as one span through the host; the
        transposed values (their first `lines` cells, CellPool.copy) whole, and not at all when there are none."""
        lines = n if lines is None else max(0, min(lines, n))
        if n > 0:
            self.copied += n
            span = np.empty(n * self.row, dtype=np.uint8)
            for t in self.k + self.v:
                g.ggml_backend_tensor_get(t, span.ctypes.data, src * self.row, span.nbytes)
                g.ggml_backend_tensor_set(t, span.ctypes.data, dst * self.row, span.nbytes)
            for t in self.v_lines if lines else ():
                a = self._read(t)
                cells = self._by_cell(a, self.cells)
                cells[dst : dst + lines] = cells[src : src + lines]
                self._write(t, a)

    def grow(self, cells: int) -> None:
        old_ctx, old_mem, old = self.ctx, self.mem, self.k + self.v + self.v_lines
        used, old_cells = self.used_end, self.cells
        saved = [self._read(t) for t in old]
        self._map(cells)
        self.copied += used
        for a, t in zip(saved, self.k + self.v + self.v_lines):
            b = self._read(t)
            self._by_cell(b, cells)[:used] = self._by_cell(a, old_cells)[:used]
            self._write(t, b)
        self._grown(old_ctx, old_mem, old_cells, cells)


class DeviceGraph(Graph):
    """A step graph computed by a backend scheduler over the device and the CPU (see the module's docstring)."""

    on_host = False  # its output is read from the device (ggml_backend_tensor_get)

    def __init__(self, on: OnDevice, *args, **kwargs):
        self.on, self.sched, self.galloc = on, None, None
        super().__init__(*args, **kwargs)

    def allocate(self) -> int:
        self.sched = self.on.scheduler(2 * self.ctx.capacity + 1024)  # its own nodes, and the weights and cells
        if not g.ggml_backend_sched_alloc_graph(self.sched, self.gf):
            self.free()
            raise MemoryError(f"ggml could not allocate a step graph's buffers on {self.on.device.name}")
        self.on.report(self.sched, self.gf)
        return sum(int(g.ggml_backend_sched_get_buffer_size(self.sched, b)) for b in (self.on.backend, self.on.cpu))

    def compute(self, backend: int) -> int:
        return int(g.ggml_backend_sched_graph_compute(self.sched, self.gf))

    def free(self) -> None:
        if self.sched:
            g.ggml_backend_sched_free(self.sched)
            self.sched = None
        super().free()
