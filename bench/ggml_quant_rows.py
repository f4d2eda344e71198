"""A few rows of a Q8_0-family weight: llamafile's tinyBLAS against ggml's vec_dot kernels, by shape and row count.

What shards/engines/ggml/quant_rows.py probes at load, on the shapes of real models: one thread, each product's
fastest of a few runs after a warm-up, the weight's own bits checked the same both ways. A weight larger than the
CPU's caches (an output head, a 7B's feed-forward) is streamed from memory at each run, as in a model's step; a small
one stays in cache across runs, which a model's weights don't (the probe's weight, of the same row length, is past the
caches for that reason).

    uv run python -m bench.ggml_quant_rows [--types q8_0 q4_0] [--rows 1,2,3,4,6,8,12,16]
"""

from __future__ import annotations

import argparse

import numpy as np

from shards.engines.ggml import quant_rows
from shards.engines.ggml.lib import QUANTIZE_TYPES, type_name

SHAPES = {  # name -> (out, in)
    "SmolLM2 head": (49152, 576),
    "SmolLM2 up": (1536, 576),
    "7B up": (14336, 4096),
    "Llama 3 head": (128256, 2048),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=["q8_0", "q4_0"], choices=["q8_0", "q4_0", "iq4_nl", "q5_0"])
    ap.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    types = {"iq4_nl": 20, "q5_0": 6, **{k: int(v) for k, v in QUANTIZE_TYPES.items()}}
    rng = np.random.default_rng(0)
    print("| type | weight | " + " | ".join(f"{n} rows" for n in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for name in args.types:
        t = types[name]
        for shape in args.shapes.split(","):
            out, k = SHAPES[shape]
            weight = quant_rows._blocks(rng, t, out, k)
            x = rng.standard_normal((max(rows), k), dtype=np.float32)
            cells = []
            for n in rows:
                same, t_tiny, t_vec = quant_rows.timed(t, weight, x[:n])
                cells.append(f"{t_tiny * 1e3:.2f} / {t_vec * 1e3:.2f}" + ("" if same else " (other bits)"))
            print(f"| {type_name(t)} | {shape} [{out}, {k}] | " + " | ".join(cells) + " |", flush=True)
    verdicts = {
        f"{name} rows of {k}": quant_rows.vec_dot_rows(types[name], k)
        for name in args.types
        for k in sorted({SHAPES[shape][1] for shape in args.shapes.split(",")})
    }
    print("\nms: tinyBLAS / vec_dot. The probe's verdicts here (the most rows vec_dot takes):", verdicts)


if __name__ == "__main__":
    main()
