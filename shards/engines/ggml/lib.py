"""ggml-python 0.0.45 (ctypes bindings of llama.cpp's ggml 0.15.3), made safe to call from the ggml engine.

Everything the engine asks of ggml goes through this module or `g`, the binding it re-exports. Three facts shape it:

- Any failed GGML_ASSERT inside ggml calls abort(): the whole node dies, no exception. So nothing here hands ggml
  a value it has not checked (tensor counts against the context's room, byte counts against ggml_nbytes, weight
  types against the supported list, rows against block sizes); GGML_NO_BACKTRACE stops ggml from attaching gdb
  when it aborts anyway.
- The binding declares four functions with a typing.NewType as restype; ctypes then returns the pointer truncated
  to a C int and its next use segfaults. `_fix_restypes` repairs them at import.
- Weights and KV caches only ever live in the plain CPU buffer type (or in memory we map ourselves and hand over as
  a CPU buffer), never in the AMX or CPU_REPACK "extra" buffer types: those crash for types they have no kernel
  for (SIGSEGV in ggml_backend_amx_mul_mat on AMX hosts, in tensor_set for Q4_1/Q8_0/Q6_K with CPU_REPACK), and
  ggml only dispatches to them for tensors placed in them.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
from collections.abc import Callable

import numpy as np

os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # read by ggml when it aborts: print the assertion, no gdb

try:
    import ggml.ggml as g
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("the ggml engine needs ggml-python: pip install 'exo-node[ggml]'") from e

from gguf import GGMLQuantizationType

from shards.formats.quant import SUPPORTED_TYPES

Tensor = "ctypes._Pointer[g.ggml_tensor]"


def _fix_restypes() -> None:
    for name in (
        "ggml_backend_cpu_buffer_type",
        "ggml_backend_alloc_buffer",
        "ggml_backend_cpu_buffer_from_ptr",
        "ggml_backend_sched_get_tensor_backend",
    ):
        getattr(g.lib, name).restype = ctypes.c_void_p


_fix_restypes()

_log = logging.getLogger("ggml")
_LEVELS = {
    g.GGML_LOG_LEVEL_ERROR: logging.ERROR,
    g.GGML_LOG_LEVEL_WARN: logging.WARNING,
    g.GGML_LOG_LEVEL_INFO: logging.DEBUG,
    g.GGML_LOG_LEVEL_DEBUG: logging.DEBUG,
}


@g.ggml_log_callback
def _forward_log(level: int, text: bytes, user_data) -> None:
    """ggml's messages (it prints each repacked tensor, for one) into Python logging instead of raw stderr."""
    if level in _LEVELS and _log.isEnabledFor(_LEVELS[level]):
        _log.log(_LEVELS[level], "%s", text.decode(errors="replace").rstrip())


g.ggml_log_set(_forward_log, None)  # the module keeps the callback object alive

# GGUF's type ids are ggml's (GGMLQuantizationType.Q4_K == GGML_TYPE_Q4_K == 12): one enum for both.
F32, F16, I32 = int(GGMLQuantizationType.F32), int(GGMLQuantizationType.F16), g.GGML_TYPE_I32
PieceHook = Callable[[np.ndarray], None] | None  # called with each piece of a weight around its copy
WEIGHT_TYPES = frozenset(int(t) for t in SUPPORTED_TYPES)  # the types the engine's tests run through ggml
QUANTIZE_TYPES = {
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_k": GGMLQuantizationType.Q4_K,
    "f16": GGMLQuantizationType.F16,
}
MAX_DIMS = 4


class GgmlError(RuntimeError):
    """ggml refused something (an allocation, a graph) in a way it reports instead of aborting."""


def default_threads() -> int:
    """All cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def row_bytes(ggml_type: int, n: int) -> int:
    """Bytes of one row of n values; n must be whole blocks (checked by the caller)."""
    return int(g.ggml_row_size(ggml_type, n))


def block_size(ggml_type: int) -> int:
    return int(g.ggml_blck_size(ggml_type))


class Context:
    """A metadata-only ggml context (no_alloc) for at most `capacity` tensors and optionally one graph of that many
    nodes. Creating more tensors than it has room for would abort inside ggml, so `room` is checked first."""

    def __init__(self, capacity: int, graph: bool = False):
        self.capacity, self.count = capacity, 0
        size = capacity * g.ggml_tensor_overhead() + (g.ggml_graph_overhead_custom(capacity, False) if graph else 0)
        self.ctx = g.ggml_init(g.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True))
        if not self.ctx:
            raise MemoryError(f"ggml_init could not reserve {size} bytes")

    def room(self, n: int = 1) -> None:
        """Claim room for n more tensors (every op creates exactly one)."""
        if self.count + n > self.capacity:
            raise GgmlError(f"ggml context full ({self.capacity} tensors); the graph is larger than estimated")
        self.count += n

    def new(self, ggml_type: int, ne: tuple[int, ...]) -> Tensor:
        if not 1 <= len(ne) <= MAX_DIMS or any(n <= 0 for n in ne):
            raise ValueError(f"bad tensor shape {ne}")
        self.room()
        return g.ggml_new_tensor(self.ctx, ggml_type, len(ne), (ctypes.c_int64 * len(ne))(*ne))

    def graph(self) -> ctypes._Pointer[g.ggml_cgraph]:
        return g.ggml_new_graph_custom(self.ctx, self.capacity, False)

    def free(self) -> None:
        if self.ctx:
            g.ggml_free(self.ctx)
            self.ctx = None


def cpu_buffer_type() -> int:
    """The plain host buffer type: generic ggml-cpu kernels for every type, never AMX or repacked layouts."""
    return g.ggml_backend_cpu_buffer_type()


def _extra_buffer_types() -> list[int]:
    """The CPU device's "extra" buffer types (CPU_REPACK, AMX where compiled in)."""
    dev = g.ggml_backend_dev_by_type(g.GGML_BACKEND_DEVICE_TYPE_CPU)
    proc = g.ggml_backend_reg_get_proc_address(g.ggml_backend_dev_backend_reg(dev), b"ggml_backend_dev_get_extra_bufts")
    if not proc:
        return []
    listed = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(proc)(dev)
    out, i = [], 0
    while listed[i]:
        out.append(listed[i])
        i += 1
    return out


_REPACK: list[int | None] = []


def repack_buffer_type() -> int | None:
    """CPU_REPACK, the one extra buffer type the engine may use (never AMX): weights placed in it are re-laid out
    for interleaved kernels, faster in prefill and batched decode (docs/benchmarks-log.md, figures once in code)."""
    if not _REPACK:
        _REPACK.append(next((b for b in _extra_buffer_types() if g.ggml_backend_buft_name(b) == b"CPU_REPACK"), None))
    return _REPACK[0]


def repack_supported(ggml_type: int, ne: tuple[int, ...]) -> bool:
    """Would CPU_REPACK take a matmul weight of this type and shape (2-D, or 3-D stacked experts for mul_mat_id) on
    this CPU and build? Placing one it has no kernel for segfaults (Q4_1, Q8_0, Q6_K here), and one whose rows don't
    interleave aborts. llama.cpp's probe: a dummy mul_mat (mul_mat_id) whose weight claims a zero-size CPU_REPACK
    buffer, asked through ggml_backend_dev_supports_op."""
    buft = repack_buffer_type()
    if buft is None or len(ne) not in (2, 3):
        return False
    dev = g.ggml_backend_dev_by_type(g.GGML_BACKEND_DEVICE_TYPE_CPU)
    ctx, buf = Context(4), g.ggml_backend_buft_alloc_buffer(buft, 0)
    try:
        w = ctx.new(ggml_type, ne)
        if len(ne) == 3:  # stacked experts: the mul_mat_id a MoE layer runs (2 of them for each of 8 rows)
            op = g.ggml_mul_mat_id(ctx.ctx, w, ctx.new(F32, (ne[0], 2, 8)), ctx.new(I32, (2, 8)))
        else:
            op = g.ggml_mul_mat(ctx.ctx, w, ctx.new(F32, (ne[0], 8)))
        w.contents.buffer = buf  # claims residency, allocates nothing
        return bool(g.ggml_backend_dev_supports_op(dev, op))
    finally:
        if buf:
            g.ggml_backend_buffer_free(buf)
        ctx.free()


class WeightArena:
    """Weights packed one after another into large anonymous mappings that ggml sees as CPU buffers.

    Huge pages: decode streams every weight once per token, and with 4 KiB pages the TLB misses cost a share of
    decode speed that llama.cpp, reading its mmap, doesn't pay (docs/benchmarks-log.md, figures once in code). So
    each chunk is advised MADV_HUGEPAGE (Linux; elsewhere plain pages) and starts on a 2 MiB boundary. Pages
    are only backed as weights are copied in, so resident memory stays the weights' bytes (plus at most one
    partly filled huge page per chunk until the chunk is sealed: `seal` gives back its pages past the last weight)."""

    CHUNK = 64 << 20
    HUGE = 2 << 20

    def __init__(self):
        self.chunks: list[MappedBuffer] = []
        self.repacked: list[int] = []  # CPU_REPACK buffers, one per weight
        self.at = self.end = 0  # free range of the newest chunk (addresses)
        self.nbytes = 0

    def place(
        self, tensor: Tensor, pieces: list[np.ndarray], before: PieceHook = None, after: PieceHook = None
    ) -> None:
        """Copy `pieces` (C-contiguous, together exactly ggml_nbytes(tensor) bytes, in order) into the arena as
        `tensor`'s storage, calling `before` and `after` around each piece's copy (a check, dropping its pages)."""
        size = int(g.ggml_nbytes(tensor))
        if sum(p.nbytes for p in pieces) != size or not all(p.flags.c_contiguous for p in pieces):
            raise ValueError(f"weight data has {sum(p.nbytes for p in pieces)} bytes, ggml expects {size}")
        if self.at + size > self.end:
            self.seal()
            chunk = MappedBuffer(max(self.CHUNK, size) + self.HUGE, huge=True)
            self.chunks.append(chunk)
            self.at = -(-chunk.base // self.HUGE) * self.HUGE
            self.end = chunk.base + chunk.size
        if g.ggml_backend_tensor_alloc(self.chunks[-1].buf, tensor, self.at) != 0:
            raise GgmlError("ggml_backend_tensor_alloc failed")
        set_pieces(tensor, pieces, before, after)
        self.at += -(-size // 64) * 64
        self.nbytes += size

    def seal(self) -> None:
        """The newest chunk's pages past its last weight go back to the kernel (a huge page is split), and stay out of
        huge pages (else khugepaged may collapse the split page whole again): weights placed later fault theirs in."""
        if self.chunks and hasattr(mmap, "MADV_DONTNEED"):
            chunk = self.chunks[-1]
            first = -(-(self.at - chunk.base) // mmap.PAGESIZE) * mmap.PAGESIZE
            if first < chunk.size:
                if hasattr(mmap, "MADV_NOHUGEPAGE"):
                    chunk.map.madvise(mmap.MADV_NOHUGEPAGE, first, chunk.size - first)
                chunk.map.madvise(mmap.MADV_DONTNEED, first, chunk.size - first)

    def place_repacked(self, tensor: Tensor, data: np.ndarray) -> None:
        """Copy a matmul weight that `repack_supported` accepted into its own CPU_REPACK buffer (ggml re-lays the
        blocks out as it copies them in)."""
        size = int(g.ggml_nbytes(tensor))
        if data.nbytes != size or not data.flags.c_contiguous:
            raise ValueError(f"weight data has {data.nbytes} bytes, ggml expects {size}")
        buf = g.ggml_backend_buft_alloc_buffer(repack_buffer_type(), size)
        if not buf:
            raise MemoryError(f"could not allocate {size} bytes for a weight")
        self.repacked.append(buf)
        advise_huge_pages(g.ggml_backend_buffer_get_base(buf), size)  # before the copy backs the pages
        if g.ggml_backend_tensor_alloc(buf, tensor, g.ggml_backend_buffer_get_base(buf)) != 0:
            raise GgmlError("ggml_backend_tensor_alloc failed")
        g.ggml_backend_tensor_set(tensor, data.ctypes.data, 0, size)
        self.nbytes += size

    def free(self) -> None:
        for chunk in self.chunks:
            chunk.free()
        for buf in self.repacked:
            g.ggml_backend_buffer_free(buf)
        self.chunks, self.repacked = [], []


def set_pieces(tensor: Tensor, pieces: list[np.ndarray], before: PieceHook = None, after: PieceHook = None) -> None:
    """A placed tensor's bytes from `pieces`, in order, with `before` and `after` called around each piece's copy."""
    offset = 0
    for p in pieces:
        if before is not None:
            before(p)
        g.ggml_backend_tensor_set(tensor, p.ctypes.data, offset, p.nbytes)
        offset += p.nbytes
        if after is not None:
            after(p)


class MappedBuffer:
    """Anonymous memory mapped by us and handed to ggml as a CPU buffer: zero-filled by the kernel, and backed by RAM
    only as it is written. For KV caches, whose cells beyond a request's length must read as zeros (a stale NaN
    times a zero attention weight is still NaN) and whose reservation may be far larger than what gets used."""

    def __init__(self, size: int, huge: bool = False):
        self.size = size
        # private: counted as the process's own (anonymous) memory, and eligible for transparent huge pages, which
        # shared anonymous memory (shmem) usually is not
        self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            self.map.madvise(mmap.MADV_HUGEPAGE)
        self._anchor = ctypes.c_char.from_buffer(self.map)  # pins the mapping while ggml points into it
        self.base = ctypes.addressof(self._anchor)
        self.buf = g.ggml_backend_cpu_buffer_from_ptr(self.base, size)
        if not self.buf:
            self._unmap()
            raise MemoryError(f"ggml could not wrap {size} bytes")

    def place(self, tensor: Tensor, offset: int) -> None:
        if offset % 64 or offset + int(g.ggml_nbytes(tensor)) > self.size:
            raise ValueError("tensor does not fit the mapped buffer")
        if g.ggml_backend_tensor_alloc(self.buf, tensor, self.base + offset) != 0:
            raise GgmlError("ggml_backend_tensor_alloc failed")

    def _unmap(self) -> None:
        del self._anchor
        self.map.close()

    def free(self) -> None:
        if self.buf:
            g.ggml_backend_buffer_free(self.buf)  # frees ggml's bookkeeping, not our mapping
            self.buf = None
            self._unmap()


def advise_huge_pages(address: int, size: int) -> None:
    """MADV_HUGEPAGE over the whole 2 MiB pages inside [address, address+size) (Linux; a no-op elsewhere)."""
    huge = 2 << 20
    start, end = -(-address // huge) * huge, (address + size) // huge * huge
    if end > start and sys.platform.startswith("linux"):
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 14)  # MADV_HUGEPAGE


def release_file_pages(a: np.ndarray) -> None:
    """Drop this process's mapping of the file pages behind a memory-mapped array (after its bytes were copied into
    ggml), so a node's resident memory holds each weight once, not also as mapped file pages. The page cache keeps
    them; a later read faults them back in. Arrays not backed by a file mapping are left alone."""
    base = a
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    if base is None or not sys.platform.startswith("linux") or a.nbytes == 0:
        return
    page = mmap.PAGESIZE
    start = -(-a.ctypes.data // page) * page  # whole pages inside the array only
    end = (a.ctypes.data + a.nbytes) // page * page
    if end > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED


def validate_rows(ggml_type: int, data: np.ndarray, what: str) -> None:
    """ggml's own check of raw weight bytes (NaN/inf values or block scales): a damaged file is an error here, not
    garbage logits later."""
    if not g.ggml_validate_row_data(ggml_type, data.ctypes.data, data.nbytes):
        raise ValueError(f"{what}: {type_name(ggml_type)} data holds NaN or infinite values")


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> np.ndarray:
    """Raw blocks [rows, row_bytes] -> float32 `shape` with ggml's own to_float (the values gguf-py's reference code
    gives, bit for bit, in a fraction of its time: what requantizing a GGUF on load spends most of its time on)."""
    rows, n = shape
    if ggml_type not in WEIGHT_TYPES or n % block_size(ggml_type) or data.nbytes != rows * row_bytes(ggml_type, n):
        raise ValueError(f"{data.nbytes} bytes are not {rows} rows of {n} {type_name(ggml_type)} values")
    to_float = g.ggml_get_type_traits(ggml_type).contents.to_float
    if not to_float:
        raise ValueError(f"ggml cannot dequantize {type_name(ggml_type)}")
    src = np.ascontiguousarray(data)
    out = np.empty(shape, dtype=np.float32)
    to_float(src.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), rows * n)
    return out


def quantize(w: np.ndarray, ggml_type: int, threads: int = 1, importance: np.ndarray | None = None) -> np.ndarray:
    """float32 [rows, n] -> raw blocks uint8 [rows, row_bytes] with ggml's reference quantizers (llama.cpp's
    bytes, bit for bit). Rows are split over `threads` Python threads: ctypes releases the GIL during each call.
    `importance` (float32 [n], llama-quantize's imatrix for this tensor) is required by the 1-2 bit IQ types."""
    if w.ndim != 2 or w.dtype != np.float32:
        raise ValueError("quantize needs a 2-D float32 matrix")
    rows, n = w.shape
    if n % block_size(ggml_type):
        raise ValueError(f"cannot quantize rows of {n} values to {type_name(ggml_type)}")
    if importance is None and g.ggml_quantize_requires_imatrix(ggml_type):
        raise ValueError(f"quantizing to {type_name(ggml_type)} needs importance weights (an imatrix)")
    imatrix = None
    if importance is not None:
        importance = np.ascontiguousarray(importance, dtype=np.float32)
        if importance.shape != (n,) or not np.all(np.isfinite(importance)) or np.any(importance < 0):
            raise ValueError(f"importance must be {n} non-negative finite values")
        imatrix = importance.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    src = np.ascontiguousarray(w)
    out = np.empty((rows, row_bytes(ggml_type, n)), dtype=np.uint8)
    src_ptr = src.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    g.ggml_quantize_init(ggml_type)  # the IQ types' lookup grids, built once (not thread-safe inside the chunks)

    def chunk(r0: int, r1: int) -> None:
        g.ggml_quantize_chunk(ggml_type, src_ptr, out.ctypes.data, r0 * n, r1 - r0, n, imatrix)

    threads = max(1, min(threads, rows // 64 or 1))
    if threads == 1:
        chunk(0, rows)
    else:
        from concurrent.futures import ThreadPoolExecutor

        cuts = np.linspace(0, rows, threads + 1, dtype=np.int64)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(chunk, cuts[:-1], cuts[1:]))
    return out
