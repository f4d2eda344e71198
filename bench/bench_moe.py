"""The ggml engine against llama.cpp on one ~1B mixture-of-experts file (bench/moe_model.py's SHAPE_1B random
Qwen3-MoE, Q4_K, 1.0B parameters, 178M active per token; made once into /tmp, 1-3 minutes): decode and prefill on
one node against llama-bench on the same file and threads, the same through the HTTP API on one node and on 3
nodes (bench/local_cluster.py), an 8-stream aggregate, and the resident memory of a node holding a third of the
layers against those tensors' bytes in the file. One command, ~5 minutes on 2 cores (plus the model's first make):

    uv run python -m bench.bench_moe [--threads 1,2] [--tokens 48] [--small]

`--small`: the 383M shape instead (faster). llama.cpp: llama-bench from the llama.cpp build of the llama-cpp-python
sdist (--llama-bench), flash attention on, its default buffers (repacked; `--repack 0` also measured), at each thread
count of --threads (llama.cpp's threads spin at their barriers: on a loaded machine its 2-thread decode collapses,
so compare the 1-thread rows there; exo's engine lowers its threads under load by itself). Teacher-forced
agreement with llama.cpp is bench/bench_agreement.py's. Prints one JSON line per measurement with the 1-minute load
average: on a shared machine compare the lines of one run, and rerun quietly before quoting absolute figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from bench.ggml_harness import load, ours
from bench.moe_model import SHAPE_1B, parameters, random_qwen3moe
from shards.formats.loader import load_config

LLAMA_BENCH = Path("/tmp/ref/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench")


def llama_bench(binary: Path, path: Path, threads: int, repack: bool) -> dict:
    """llama-bench's prefill (256 tokens) and decode (64 tokens) rates, tok/s."""
    cmd = [str(binary), "-m", str(path), "-t", str(threads), "-fa", "1", "-p", "256", "-n", "64", "-r", "2"]
    out = subprocess.run(
        [*cmd, "--repack", str(int(repack)), "-o", "json"], capture_output=True, text=True, timeout=900
    )
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed:\n{out.stderr[-2000:]}")
    rows = json.loads(out.stdout)
    return {("prefill256" if r["n_prompt"] else "decode1"): r["avg_ts"] for r in rows}


def served(path: Path, nodes: int, threads: int, tokens: int) -> dict:
    """Through the HTTP API: one greedy stream's decode rate (median of 2) and 8 concurrent streams' aggregate
    (prefill included), on `nodes` nodes splitting the layers evenly, each with `threads` threads."""
    from bench.bench_cluster import concurrent, decode_rate, stream_stamps
    from bench.local_cluster import Cluster

    layers, model_id = load_config(path).n_layers, path.stem.lower()
    cuts = [round(i * layers / nodes) for i in range(nodes + 1)]
    shards = [f"{a}:{b}" for a, b in zip(cuts, cuts[1:])] if nodes > 1 else None
    extra = ["--threads", str(threads)]
    with Cluster(path, nodes, shards=shards, api_nodes=1, model_id=model_id, engine="ggml", extra=extra) as c:
        url = c.nodes[0].api_url
        stream_stamps(url, model_id, "warm up", 4)
        rates = [decode_rate(stream_stamps(url, model_id, f"Tell me a long story {i}.", tokens)) for i in range(2)]
        eight = concurrent(url, model_id, 8, tokens)
    return {"nodes": nodes, "threads_each": threads, "decode1": statistics.median(rates), "streams8": eight}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="thread counts to measure one node at (the API runs the last)")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per stream through the API")
    ap.add_argument("--small", action="store_true", help="the 383M shape instead of the ~1B one")
    ap.add_argument("--llama-bench", type=Path, default=LLAMA_BENCH)
    args = ap.parse_args()
    shape = {} if args.small else SHAPE_1B
    path = random_qwen3moe(**shape)
    total, active = parameters(**shape)
    cfg = load_config(path)
    third = cfg.n_layers // 3
    print(json.dumps({"model": str(path), "parameters": total, "active": active, "file_bytes": path.stat().st_size}))
    counts = [int(t) for t in args.threads.split(",")]
    for threads in counts:
        print(json.dumps({"ours": ours("speed", path, threads), "threads": threads, "load": load()}), flush=True)
        for repack in (True, False):
            row = {"llama_bench": llama_bench(args.llama_bench, path, threads, repack), "repack": repack}
            print(json.dumps(row | {"threads": threads, "load": load()}), flush=True)
    print(json.dumps({"memory_middle_third": ours("memory", path, third, 2 * third), "load": load()}), flush=True)
    for nodes, threads in ((1, counts[-1]), (3, max(1, counts[-1] // 3))):
        print(json.dumps({"api": served(path, nodes, threads, args.tokens), "load": load()}), flush=True)


if __name__ == "__main__":
    main()
