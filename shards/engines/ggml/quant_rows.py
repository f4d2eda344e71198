"""Quantized steps of 2+ rows through ggml's vec_dot kernels, where tinyBLAS's tiles are slower, or would round a row
otherwise than it is rounded alone.

ggml's CPU matmul (ggml 0.15.3, as ggml-python 0.0.45 bundles it) hands a weight whose dot-product type is Q8_0 (Q8_0
itself; Q4_0, Q5_0 and IQ4_NL in plain memory) to llamafile's tinyBLAS (llamafile/sgemm.cpp) when a step's rows are
contiguous, and to its vec_dot kernels when they are not. For most of these types both sum each block's products as
integers, then the blocks in one order, so a row gets the same bits either way, and the same as alone; but
tinyBLAS's tiles for a few rows can cost several times vec_dot's (SmolLM2's Q8_0 output head on a Zen 5 EPYC: 2 rows
4x, 4 rows 2x; from about a dozen rows on tinyBLAS is the faster: docs/benchmarks.md). For IQ4_NL (on a Zen 5
EPYC) a step's rows by tinyBLAS differ from the same rows alone, and by vec_dot they don't, so without this a row's
bits would depend on the step it is in. Which holds is the CPU's and the type's, so each (type, row length) is probed
once per process (`vec_dot_rows`): first on a small weight, whether each route gives a row the bits it gets alone
(`_exact`); then, where both do, a weight past the caches times steps of each of ROWS rows both ways. Steps of 2 up to
the verdict's rows take the vec_dot route (every step of 2+ rows where only vec_dot keeps a row's bits): their rows
converted to Q8_0 and strided (a gap of one block after each), which tinyBLAS declines, as `rowwise` does for float
weights (gemm_rows.py). Only on the CPU, and only for weights in plain memory (CPU_REPACK has kernels of its own:
repack_probe.py).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from shards.engines.ggml.host_memory import WeightArena
from shards.engines.ggml.lib import (
    F32,
    Context,
    GgmlError,
    Tensor,
    block_size,
    cpu_buffer_type,
    g,
    row_bytes,
    type_name,
)

Q8_0 = 8  # ggml's type id (gguf's GGMLQuantizationType.Q8_0)
ROWS = (2, 3, 4, 6, 8, 12, 16)  # the step sizes timed; a verdict is one of them, 0 or EVERY
EVERY = 1 << 30  # the verdict where only vec_dot gives a row its lone bits: every step of 2+ rows goes by vec_dot
EXACT_ROWS = (2, 7, 16)  # the step sizes whose rows are compared with the same rows alone
PROBE_BYTES = 48 << 20  # the timed weight: past the caches, as a model's weights are
REPEATS = 2  # runs of each product timed; the fastest counts
MARGIN = 0.9  # the vec_dot route is taken only where it takes under this share of tinyBLAS's time
_verdicts: dict[tuple[int, int], int] = {}  # (type, the weight's row length) -> rows
log = logging.getLogger(__name__)


def dot_type(ggml_type: int) -> int:
    """The type ggml's CPU converts a weight's activation rows to for its dot products (Q8_0 for Q4_0, ...)."""
    return int(g.ggml_get_type_traits_cpu(ggml_type).contents.vec_dot_type)


def candidate(ggml_type: int) -> bool:
    """A quantized type whose dot products take Q8_0 rows: the types tinyBLAS may take."""
    return ggml_type != F32 and block_size(ggml_type) > 1 and dot_type(ggml_type) == Q8_0


def vec_dot_rows(ggml_type: int, k: int) -> int:
    """The most rows a step of a plain-memory weight of this type and row length `k` hands the vec_dot route
    (`strided_rows`): EVERY where only that route gives a row the bits it gets alone; else the last of ROWS up to
    which every count was faster by vec_dot, with the same bits; 0 where none was (or for a type tinyBLAS does not
    take). Decided once per process (tinyBLAS's tiles fare otherwise by type and by row length:
    bench/ggml_quant_rows.py)."""
    if (ggml_type, k) not in _verdicts:
        _verdicts[ggml_type, k] = verdict = _probe(ggml_type, k) if candidate(ggml_type) else 0
        if verdict == EVERY:
            log.info(
                "ggml: %s weights of rows of %d, every step of 2+ rows by vec_dot (tinyBLAS would give a row other "
                "bits than it gets alone)",
                type_name(ggml_type),
                k,
            )
        elif verdict:
            log.info(
                "ggml: %s weights of rows of %d, steps of 2-%d rows by vec_dot (faster here than tinyBLAS, the same bits)",
                type_name(ggml_type),
                k,
                verdict,
            )
    return _verdicts[ggml_type, k]


def strided_rows(ctx_node, x: Tensor, k: int, n: int) -> Tensor:
    """`x` [n, k] F32 as Q8_0 rows with a block's gap after each (`ctx_node(fn, *args)` adds a graph node): what
    ggml's mul_mat takes as its vec_dot rows as they are, and tinyBLAS declines (they are not contiguous)."""
    gap = block_size(Q8_0)
    wide = ctx_node(g.ggml_cast, ctx_node(g.ggml_pad, x, gap, 0, 0, 0), Q8_0)  # [n, k + gap] in Q8_0 blocks
    return ctx_node(g.ggml_view_2d, wide, k, n, wide.contents.nb[1], 0)


def timed(ggml_type: int, weight: np.ndarray, x: np.ndarray) -> tuple[bool, float, float]:
    """Whether both routes give `x` [n, k] times `weight` (raw blocks [out, k]) the same bits, and each one's
    seconds (tinyBLAS's, vec_dot's; the fastest of REPEATS runs, one thread)."""
    (tiny, t_tiny), (vec, t_vec) = (_product(ggml_type, weight, x, strided) for strided in (False, True))
    return np.array_equal(tiny, vec), t_tiny, t_vec


def _exact(ggml_type: int, k: int) -> tuple[bool, bool]:
    """Whether tinyBLAS, and whether the vec_dot route, gives each row of steps of EXACT_ROWS rows the bits the
    same row gets alone (a small weight: the bits do not depend on its size)."""
    rng = np.random.default_rng(3)
    weight = _blocks(rng, ggml_type, 64, k)
    x = rng.standard_normal((max(EXACT_ROWS), k), dtype=np.float32)
    alone = np.concatenate([_product(ggml_type, weight, x[i : i + 1], False, 0)[0] for i in range(len(x))])
    tiny = vec = True
    for n in EXACT_ROWS:
        tiny = tiny and np.array_equal(_product(ggml_type, weight, x[:n], False, 0)[0], alone[:n])
        vec = vec and np.array_equal(_product(ggml_type, weight, x[:n], True, 0)[0], alone[:n])
    return tiny, vec


def _probe(ggml_type: int, k: int) -> int:
    tiny_exact, vec_exact = _exact(ggml_type, k)
    if not tiny_exact:
        if not vec_exact:
            log.warning(
                "ggml: %s weights of rows of %d give a row other bits in a step than alone", type_name(ggml_type), k
            )
        return EVERY if vec_exact else 0
    if not vec_exact:
        return 0
    rng = np.random.default_rng(2)
    weight = _blocks(rng, ggml_type, max(64, PROBE_BYTES // row_bytes(ggml_type, k)), k)
    x = rng.standard_normal((max(ROWS), k), dtype=np.float32)
    verdict = 0
    for n in ROWS:
        same, t_tiny, t_vec = timed(ggml_type, weight, x[:n])
        if not same or t_vec >= MARGIN * t_tiny:
            break
        verdict = n
    return verdict


def _blocks(rng: np.random.Generator, ggml_type: int, out: int, k: int) -> np.ndarray:
    """A weight [out, k] of random blocks (quantizing one this size would take longer than the probe): every type of
    the Q8_0 family starts its block with an F16 scale, set to 1/64; any bits after it are valid."""
    raw = rng.integers(0, 256, (out, row_bytes(ggml_type, k)), dtype=np.uint8)
    blocks = raw.reshape(out, k // block_size(ggml_type), -1)
    blocks[:, :, :2] = np.frombuffer(np.float16(1 / 64).tobytes(), np.uint8)
    return raw


def _product(
    ggml_type: int, weight: np.ndarray, x: np.ndarray, strided: bool, repeats: int = REPEATS
) -> tuple[np.ndarray, float]:
    """`x` [n, k] times `weight` (raw blocks [out, k]) on one thread, as ggml multiplies contiguous rows (tinyBLAS
    for 2+) or (`strided`) by vec_dot: the product and the fastest of `repeats` timed runs' seconds (0 for none)."""
    (n, k), out = x.shape, len(weight)
    ctx, arena, galloc, backend = Context(8, graph=True), WeightArena(), None, None
    try:
        w = ctx.new(ggml_type, (k, out))
        arena.place(w, [weight])
        xt = ctx.new(F32, (k, n))
        g.ggml_set_input(xt)
        g.ggml_set_output(xt)  # (else the allocator reuses its memory, and a second run reads another op's bytes)

        def node(fn, *args):
            ctx.room()
            return fn(ctx.ctx, *args)

        y = node(g.ggml_mul_mat, w, strided_rows(node, xt, k, n) if strided else xt)
        g.ggml_set_output(y)
        gf = ctx.graph()
        g.ggml_build_forward_expand(gf, y)
        galloc = g.ggml_gallocr_new(cpu_buffer_type())
        if not galloc or not g.ggml_gallocr_alloc_graph(galloc, gf):
            raise MemoryError("ggml could not allocate the quantized-rows probe's graph")
        g.ggml_backend_tensor_set(xt, x.ctypes.data, 0, x.nbytes)
        backend = g.ggml_backend_cpu_init()
        g.ggml_backend_cpu_set_n_threads(backend, 1)
        times = []
        for _ in range(repeats + 1):  # the first run warms the caches and is not counted
            began = time.perf_counter()
            if g.ggml_backend_graph_compute(backend, gf) != 0:
                raise GgmlError("the quantized-rows probe's graph failed to compute")
            times.append(time.perf_counter() - began)
        product = np.empty((n, out), np.float32)
        g.ggml_backend_tensor_get(y, product.ctypes.data, 0, product.nbytes)
        return product, min(times[1:], default=0.0)
    finally:
        if backend:
            g.ggml_backend_free(backend)
        if galloc:
            g.ggml_gallocr_free(galloc)
        arena.free()
        ctx.free()
