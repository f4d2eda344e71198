"""How the ggml engine copies a shard's weights out of the model file (shards/engines/ggml/weight_placement.py): a
weight that isn't repacked is checked and copied a slice at a time, each slice's file pages dropped from the process
once copied, so loading never holds a whole tensor's pages beside its copy. A 7B model's head is ~100 MB, a 70B's
~1 GB: on a node sized to its share that was the difference between loading and being killed."""

import ctypes
import mmap
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.ggml import weight_placement
from shards.engines.ggml.host_memory import WeightArena
from shards.engines.ggml.lib import g
from shards.engines.ggml.weight_placement import SLICE_BYTES, GgmlWeights
from tests.support.cluster import ROOT

KB = 1024


def mapped_kb(path) -> int:
    """This process's resident memory mapped from `path` (kB, /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0] and not line.startswith(("Rss", "Size")):
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_a_weight_is_copied_a_slice_at_a_time_and_its_file_pages_dropped_as_it_goes(tmp_path, monkeypatch):
    path = tmp_path / "weight.f32"
    rows, width = 3 * SLICE_BYTES // (4 * KB) + 5, KB  # three slices and a bit
    want = np.random.default_rng(0).standard_normal((rows, width)).astype(np.float32)
    want.tofile(path)
    stored = np.memmap(path, dtype=np.float32, mode="r", shape=(rows, width))
    seen = []
    release = weight_placement.release_file_pages

    def measured(a):
        seen.append(mapped_kb(path))  # what is mapped as a slice's copy ends, before its pages go
        release(a)

    monkeypatch.setattr(weight_placement, "release_file_pages", measured)
    weights = GgmlWeights(4, repack=False)
    w = weights.weight(stored)
    assert len(seen) == 4 and max(seen) <= SLICE_BYTES // KB + 8  # one slice, and a page either side
    assert mapped_kb(path) <= 4 * 4  # a page at each slice's boundary at most
    got = np.empty_like(want)
    g.ggml_backend_tensor_get(w.tensor, got.ctypes.data, 0, got.nbytes)
    np.testing.assert_array_equal(got, want)
    weights.free()


def resident_bytes(chunk) -> int:
    """Bytes of a mapping backed by memory now (mincore)."""
    libc, page = ctypes.CDLL(None, use_errno=True), mmap.PAGESIZE
    n = -(-chunk.size // page)
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(chunk.base), ctypes.c_size_t(n * page), vec) == 0
    return sum(b & 1 for b in vec) * page


def test_the_weights_resident_memory_is_their_bytes_whatever_huge_pages_their_chunks_took(monkeypatch):
    """Each chunk of the arena is advised huge pages (decode reads every weight per token); the huge page a chunk's
    last weight ends in is given back past it once the next chunk starts, or the model is loaded. Not giving it
    back cost a 7B shard 27 MB, a 2 MB page per chunk."""
    monkeypatch.setattr(WeightArena, "CHUNK", 4 << 20)
    weights = GgmlWeights(8, repack=False)
    rng = np.random.default_rng(1)
    for _ in range(5):  # each 3 MB and a bit: a chunk each, each ending inside a huge page
        weights.weight(rng.standard_normal((3 * 256 + 7, KB)).astype(np.float32))
    weights.loaded()
    chunks = weights.arena.chunks
    assert len(chunks) == 5
    assert sum(resident_bytes(c) for c in chunks) <= weights.arena.nbytes + 2 * len(chunks) * mmap.PAGESIZE
    weights.free()


FREED_AFTER_A_LARGER_FREE = """
import ctypes, sys
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "fixed":
    from shards.engines.ggml.host_memory import unmap_large_blocks
    unmap_large_blocks()
def rss_kb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
def touched(n):
    p = libc.malloc(n)
    libc.memset(ctypes.c_void_p(p), 1, ctypes.c_size_t(n))
    return p
libc.free(touched(16 << 20))  # glibc's threshold rises to this block's size: blocks under it now come from the heap
before = rss_kb()
libc.free(touched(8 << 20))  # a graph's compute buffer, say, dropped from the cache
print(rss_kb() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_large_block_freed_leaves_the_process_even_after_a_larger_one_was_freed():
    """glibc raises its mmap threshold to the size of each mapped block freed, and blocks under it then come from a
    heap that keeps them: a graph's buffer dropped from the cache stayed resident. The ggml engine fixes the
    threshold, so a freed buffer of megabytes goes back at once (each run in a process of its own: the setting is
    the process's)."""
    kept = {}
    for mode in ("fixed", "glibc's default"):
        code = [sys.executable, "-c", FREED_AFTER_A_LARGER_FREE, mode]
        out = subprocess.run(code, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        kept[mode] = int(out.stdout)
    assert kept["fixed"] < 1024 and kept["glibc's default"] > 4 * 1024, kept  # kB still resident of the 8 MB freed
