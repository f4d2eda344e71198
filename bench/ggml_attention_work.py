"""The ggml engine's attention work per step, counted from its graphs rather than timed (so the same on a busy
machine): for each attention (attention.ATTENTION "flash" and "gemm", each with its pool's layout of values), one
decode row over a request of 1,024 positions and the first and last 256-row chunks of a 2,048-token prompt, on the
packaged SmolLM2's first layer (every layer does the same work). Per step and layer: the span of cells attended,
the (row, cell) pairs visible, the F16 matmuls' FLOPs (gemm attention's two), flash attention's (rows x heads x
visible cells x 4 x head_dim, what its one-row kernel computes), the bytes the graph's copies write, and the rows
ggml_set_rows writes. The held positions are committed without being computed: a graph's work depends on the shape
of the cells it attends, not on what they hold.

    uv run python -m bench.ggml_attention_work [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from shards.engines.base import StepInput
from shards.engines.ggml import attention as ggml_attention
from shards.engines.ggml.cells import CellRange
from shards.engines.ggml.engine import GgmlEngine
from shards.engines.ggml.lib import F16, g
from shards.formats.loader import load_config
from shards.formats.packaged import resolve_model
from shards.model.shard import Shard

STEPS = {"decode@1k": (1023, 1, 1024), "prefill 0-255": (0, 256, 2048), "prefill 1792-2047": (1792, 256, 2048)}


def work(attention: str, held: int, rows: int, reserved: int) -> dict:
    ggml_attention.ATTENTION = attention  # before the engine: its pool's layouts of values follow it
    path = resolve_model("smollm2")[0]
    cfg = dataclasses.replace(load_config(path), n_layers=1)
    e = GgmlEngine(path, Shard("m", 0, 1, 1), cfg, threads=1, quantize="none", adapt_threads=False)
    try:
        if held:
            cache = CellRange(e.pool, reserved)
            cache.limit = reserved
            cache.commit(held)
            e.caches["r"] = cache
        tokens = np.random.default_rng(0).integers(100, 5000, rows)
        e.forward([StepInput("r", tokens=tokens, max_positions=reserved)])
        graph, step = next(reversed(e.graphs.graphs.values())), e.runner.last
        matmul = flash = set_rows = 0
        for i in range(graph.nodes):
            t = g.ggml_graph_node(graph.gf, i).contents
            op = g.ggml_op_name(t.op)
            if op == b"MUL_MAT" and t.src[0].contents.type == F16:  # the weights are Q4_1: these are attention's
                matmul += 2 * int(t.src[0].contents.ne[0]) * int(t.ne[0]) * int(t.ne[1]) * int(t.ne[2])
            elif op == b"FLASH_ATTN_EXT":  # q ne [hd, rows, heads]; the kernel skips masked cells
                q = t.src[0].contents
                flash += int(q.ne[1]) * int(q.ne[2]) * step.visible // step.rows * 4 * cfg.head_dim
            elif op == b"SET_ROWS":
                set_rows += int(t.src[0].contents.ne[1]) * int(t.src[0].contents.ne[2])
        return {
            "span": graph.shape.groups[0].cells,
            "visible": step.visible,
            "f16_matmul_mflop": round(matmul / 1e6, 2),
            "flash_mflop": round(flash / 1e6, 2),
            "copied_kb": round(graph.copied_bytes() / 1e3, 1),
            "set_rows": set_rows,
            "nodes": graph.nodes,
        }
    finally:
        e.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = ap.parse_args()
    out = {f"{name} {a}": work(a, *shape) for name, shape in STEPS.items() for a in ("flash", "gemm")}
    if args.json:
        print(json.dumps(out))
        return
    cols = list(next(iter(out.values())))
    print(f"{'step':24}" + "".join(f"{c:>18}" for c in cols))
    for name, row in out.items():
        print(f"{name:24}" + "".join(f"{row[c]:>18}" for c in cols))


if __name__ == "__main__":
    main()
