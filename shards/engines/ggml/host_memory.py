"""Host memory the ggml engine hands to ggml: the weight arena (weights packed into huge-page mappings, or CPU_REPACK
buffers), anonymous mappings wrapped as CPU buffers (KV cells), and the page advice around them: huge pages for
weights, a model file's pages dropped once copied."""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable

import numpy as np

from shards.engines.ggml.lib import GgmlError, Tensor, g, repack_buffer_type

LARGE_BLOCK = 4 << 20  # malloc maps blocks this large and more: `unmap_large_blocks`
PieceHook = Callable[[np.ndarray], None] | None  # called with each piece of a weight around its copy


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


def unmap_large_blocks() -> None:
    """Fix glibc's mmap threshold for the process at LARGE_BLOCK (Linux with glibc; elsewhere nothing).

    glibc raises the threshold to the size of each mapped block freed (up to 32 MiB on 64-bit), and blocks under it
    come from heaps that don't shrink. A load's 8 MiB slices raised it, after which a prompt chunk's compute buffer
    came from a heap and, dropped from the graph cache, stayed in the node's resident memory. Fixed, blocks this
    large are mapped and go back to the system when freed; smaller ones (a step's logits, a decode graph's buffer)
    still come from the heap, reused without page faults, step after step."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt(-3, LARGE_BLOCK)  # M_MMAP_THRESHOLD (malloc.h); musl's mallopt ignores it
    except AttributeError:  # a libc without mallopt
        pass
