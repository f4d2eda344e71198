"""When does ggml's CPU matmul give a row other numbers than it gets alone?

The same activation rows are multiplied by one weight matrix alone (1 row) and inside batches of 2..N rows, for each
weight type and thread count asked; every row of every batch is compared bitwise with (a) the row alone and (b) the
row inside a batch of 2. Prints, per type and thread count, the batch sizes where (a) or (b) differ and the largest
difference seen. ggml's CPU matmul (ggml-cpu.c, ggml 0.15.3 as bundled by ggml-python 0.0.45) takes
llamafile's tinyBLAS (sgemm.cpp) for F16/F32/BF16 weights when the step has 2+ rows, and its vec_dot kernels for 1
row: `bench/ggml_matmul_rows.py --types f16 f32 q8_0` shows which of the two changes a row.

    .venv/bin/python -m bench.ggml_matmul_rows [--rows 70] [--threads 1 2 4] [--types f16 f32 q4_1 q8_0]
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np

from shards.engines.ggml.lib import F32, QUANTIZE_TYPES, g, quantize

TYPES = {"f32": F32, "bf16": 30, **{k: int(v) for k, v in QUANTIZE_TYPES.items()}, "q4_1": 3}


class Matmul:
    """One weight [out, k] in an allocating ggml context; `__call__` multiplies `x` [n, k] by it on `threads`."""

    def __init__(self, w: np.ndarray, ggml_type: int):
        out, k = w.shape
        self.k, self.out, self.type = k, out, ggml_type
        if ggml_type == F32:
            self.raw = np.ascontiguousarray(w, dtype=np.float32)
        elif ggml_type == TYPES["f16"]:
            self.raw = np.ascontiguousarray(w, dtype=np.float16)
        else:
            self.raw = quantize(np.ascontiguousarray(w, dtype=np.float32), ggml_type)

    def __call__(self, x: np.ndarray, threads: int) -> np.ndarray:
        n = x.shape[0]
        size = self.raw.nbytes + 2 * x.nbytes + 4 * n * self.out + (8 << 20)
        ctx = g.ggml_init(g.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=False))
        try:
            w = g.ggml_new_tensor_2d(ctx, self.type, self.k, self.out)
            ctypes.memmove(w.contents.data, self.raw.ctypes.data, self.raw.nbytes)
            a = g.ggml_new_tensor_2d(ctx, F32, self.k, n)
            xs = np.ascontiguousarray(x, dtype=np.float32)
            ctypes.memmove(a.contents.data, xs.ctypes.data, xs.nbytes)
            y = g.ggml_mul_mat(ctx, w, a)
            graph = g.ggml_new_graph(ctx)
            g.ggml_build_forward_expand(graph, y)
            g.ggml_graph_compute_with_ctx(ctx, graph, threads)
            out = np.empty((n, self.out), dtype=np.float32)
            ctypes.memmove(out.ctypes.data, y.contents.data, out.nbytes)
            return out
        finally:
            g.ggml_free(ctx)


def probe(mm: Matmul, x: np.ndarray, max_rows: int, threads: int) -> tuple[list[int], list[int], float]:
    """(batch sizes where a row differs from itself alone, sizes where it differs from itself in a batch of 2,
    largest absolute difference from alone)."""
    alone = np.stack([mm(x[i : i + 1], threads)[0] for i in range(max_rows)])
    pair = np.stack([mm(x[i : i + 2], threads)[0] for i in range(max_rows)])
    vs_alone, vs_pair, worst = [], [], 0.0
    for n in range(2, max_rows + 1):
        y = mm(x[:n], threads)
        if not np.array_equal(y, alone[:n]):
            vs_alone.append(n)
            worst = max(worst, float(np.abs(y - alone[:n]).max()))
        if not np.array_equal(y, pair[:n]):
            vs_pair.append(n)
    return vs_alone, vs_pair, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=70)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--types", nargs="+", default=["f16", "f32", "q4_1", "q8_0"], choices=sorted(TYPES))
    ap.add_argument("--shape", type=int, nargs=2, default=[1536, 576], metavar=("OUT", "IN"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    w = rng.standard_normal(args.shape).astype(np.float32) * 0.05
    x = rng.standard_normal((args.rows + 1, args.shape[1])).astype(np.float32)
    print(
        f"ggml CPU: avx2={g.ggml_cpu_has_avx2()} avx512={g.ggml_cpu_has_avx512()} f16c={g.ggml_cpu_has_f16c()} "
        f"llamafile={g.ggml_cpu_has_llamafile()}; weight {args.shape[0]}x{args.shape[1]}, batches 2..{args.rows}"
    )
    for name in args.types:
        mm = Matmul(w, TYPES[name])
        for threads in args.threads:
            vs_alone, vs_pair, worst = probe(mm, x, args.rows, threads)
            print(
                f"{name:5} threads={threads}: rows differing from alone in batches {_ranges(vs_alone)} "
                f"(max |diff| {worst:.3g}); from a batch of 2 in {_ranges(vs_pair)}"
            )


def _ranges(ns: list[int]) -> str:
    if not ns:
        return "none"
    out, start = [], ns[0]
    for a, b in zip(ns, ns[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


if __name__ == "__main__":
    main()
