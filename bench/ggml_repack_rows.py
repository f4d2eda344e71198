"""What a quantized weight's matmul costs per activation row, in plain memory and in CPU_REPACK, and which row counts
give a row its own numbers: why a Q4_K model decodes at llama.cpp's speed with repacking off and batches no better
than one row at a time here (docs/benchmarks.md, "A 7B-shaped Q4_K_M").

One weight [OUT, IN] of the type asked (default Q4_K at a 7B feed-forward's 14336 x 4096), placed as the ggml engine
places weights (shards/engines/ggml/host_memory.py): in plain host memory, and where ggml takes it, in CPU_REPACK,
whose kernels multiply rows four at a time (a gemm) and the rest one at a time (a gemv). For each layout and row
count: the median time of one matmul (one graph, computed again and again on `--threads`), and whether a row gets
the bits it gets alone when it is the first (a gemm's) or the last (a gemv's, where the count is not a multiple of 4)
of the batch; for CPU_REPACK also against the row padded with zero rows to four, which every multiple of 4 reads
through the gemm only.

    uv run python -m bench.ggml_repack_rows [--type Q4_K] [--shape 14336 4096] [--threads 1] [--rows 1,2,3,4,8,16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import numpy as np

from shards.engines.ggml.host_memory import WeightArena
from shards.engines.ggml.lib import F32, Context, cpu_buffer_type, g, quantize, repack_supported


class Matmul:
    """x [n, IN] times the weight, in one graph for n rows, with the weight in plain memory or in CPU_REPACK."""

    def __init__(
        self, raw: np.ndarray, ggml_type: int, shape: tuple[int, int], rows: int, repacked: bool, threads: int
    ):
        out, k = shape
        self.rows, self.out = rows, out
        self.ctx, self.arena = Context(4, graph=True), WeightArena()
        w = self.ctx.new(ggml_type, (k, out))
        if repacked:
            self.arena.place_repacked(w, raw)
        else:
            self.arena.place(w, [raw])
            self.arena.seal()
        self.x = self.ctx.new(F32, (k, rows))
        self.ctx.room()
        self.y = g.ggml_mul_mat(self.ctx.ctx, w, self.x)
        g.ggml_set_input(self.x)
        g.ggml_set_output(self.y)
        self.graph = self.ctx.graph()
        g.ggml_build_forward_expand(self.graph, self.y)
        self.galloc = g.ggml_gallocr_new(cpu_buffer_type())
        if not self.galloc or not g.ggml_gallocr_alloc_graph(self.galloc, self.graph):
            raise MemoryError("ggml could not allocate the matmul's graph")
        self.backend = g.ggml_backend_cpu_init()
        g.ggml_backend_cpu_set_n_threads(self.backend, threads)

    def __call__(self, x: np.ndarray, repeats: int = 1) -> tuple[float, np.ndarray]:
        """The median seconds of `repeats` computes, and the product [n, OUT]."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        g.ggml_backend_tensor_set(self.x, x.ctypes.data, 0, x.nbytes)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            if g.ggml_backend_graph_compute(self.backend, self.graph) != 0:
                raise RuntimeError("the matmul's graph failed to compute")
            times.append(time.perf_counter() - began)
        y = np.empty((self.rows, self.out), np.float32)
        g.ggml_backend_tensor_get(self.y, y.ctypes.data, 0, y.nbytes)
        return statistics.median(times), y

    def free(self) -> None:
        g.ggml_backend_free(self.backend)
        g.ggml_gallocr_free(self.galloc)
        self.arena.free()
        self.ctx.free()


def measure(ggml_type: int, shape: tuple[int, int], row_counts: list[int], threads: int, repeats: int) -> list[dict]:
    """One dict per layout and row count: ms per matmul and per row, and the bits verdicts (see the docstring)."""
    rng = np.random.default_rng(0)
    raw = quantize(rng.standard_normal(shape, dtype=np.float32) * shape[1] ** -0.5, ggml_type)
    row = rng.standard_normal((1, shape[1]), dtype=np.float32)
    others = rng.standard_normal((max(row_counts), shape[1]), dtype=np.float32)
    layouts = ["plain"] + (["CPU_REPACK"] if repack_supported(ggml_type, (shape[1], shape[0])) else [])
    results = []
    for layout in layouts:
        alone = padded = None
        for n in sorted(set(row_counts) | {1, 4}):
            mm = Matmul(raw, ggml_type, shape, n, layout == "CPU_REPACK", threads)
            try:
                first, last = others[:n].copy(), others[:n].copy()
                first[0], last[n - 1] = row[0], row[0]
                seconds, y_first = mm(first, repeats)
                y_last = mm(last)[1][n - 1]
            finally:
                mm.free()
            if n == 1:
                alone = y_first[0]
            if n == 4:
                padded = _padded(raw, ggml_type, shape, row, threads) if layout == "CPU_REPACK" else None
            if n in row_counts:
                results.append(
                    {
                        "layout": layout,
                        "rows": n,
                        "ms": round(seconds * 1e3, 3),
                        "ms_per_row": round(seconds * 1e3 / n, 3),
                        "first_as_alone": bool(np.array_equal(y_first[0], alone)),
                        "last_as_alone": bool(np.array_equal(y_last, alone)),
                        "first_as_padded": None if padded is None else bool(np.array_equal(y_first[0], padded)),
                        "last_as_padded": None if padded is None else bool(np.array_equal(y_last, padded)),
                    }
                )
    return results


def _padded(raw: np.ndarray, ggml_type: int, shape: tuple[int, int], row: np.ndarray, threads: int) -> np.ndarray:
    """The row's product when it is padded with three zero rows (CPU_REPACK's gemm, never its gemv)."""
    mm = Matmul(raw, ggml_type, shape, 4, True, threads)
    try:
        return mm(np.concatenate([row, np.zeros((3, shape[1]), np.float32)]))[1][0]
    finally:
        mm.free()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--type", default="Q4_K", choices=[t.name for t in gguf.GGMLQuantizationType])
    ap.add_argument("--shape", type=int, nargs=2, default=[14336, 4096], metavar=("OUT", "IN"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,3,4,8,16")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    rows = [int(n) for n in args.rows.split(",")]
    if not rows or min(rows) < 1:
        ap.error("--rows: counts of 1 or more")
    results = measure(int(gguf.GGMLQuantizationType[args.type]), tuple(args.shape), rows, args.threads, args.repeats)
    print(f"{args.type} weight {args.shape[0]} x {args.shape[1]}, {args.threads} thread(s), median of {args.repeats}")
    print("| layout | rows | ms | ms a row | first row as alone | last row as alone | first / last as padded to 4 |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        padded = "" if r["first_as_padded"] is None else f"{_yes(r['first_as_padded'])} / {_yes(r['last_as_padded'])}"
        print(
            f"| {r['layout']} | {r['rows']} | {r['ms']} | {r['ms_per_row']} | {_yes(r['first_as_alone'])} | "
            f"{_yes(r['last_as_alone'])} | {padded} |"
        )


def _yes(same: bool) -> str:
    return "same" if same else "differs"


if __name__ == "__main__":
    main()
