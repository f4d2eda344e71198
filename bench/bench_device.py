"""The ggml engine on a GPU backend's device against the same engine on the CPU: prefill and decode speed of a
random Llama in F16, in process (no HTTP, no gRPC), the same steps on both.

A random model (bench/large_model.py's writer) measures what a real one of its shape would: the kernels see the
same shapes and types. Per device: a prompt of --prompt tokens in one step (tokens/s), then --steps decode steps of
one row (ms a token) and of --rows rows side by side (tokens/s in all). The figures go to docs/benchmarks.md.

    python -m bench.bench_device --shape 1b --device cuda          # -> a table, and --json FILE if given
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from bench.large_model import LARGE, write_f16
from shards.engines.base import StepInput
from shards.engines.ggml.engine import GgmlEngine
from shards.formats.loader import load_config
from shards.model.shard import Shard

SHAPES = {
    # SmolLM2-135M's body (the packaged model's shape): 0.16B parameters with its 49152-piece vocabulary
    "135m": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
    ),
    # Llama-3.2-1B's body on a 32000-piece vocabulary: 1.1B parameters, 2.2 GB in F16
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=32000,
    ),
    "7b": LARGE,  # Llama-3-8B's body: 7.24B parameters, 14.5 GB in F16
}


def model(shape: str, cache: Path) -> Path:
    path = cache / f"random-{shape}-f16.gguf"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        write_f16(tmp, SHAPES[shape])
        tmp.rename(path)
    return path


def measure(path: Path, device: str | None, prompt: int, steps: int, rows: int, threads: int) -> dict:
    """One engine on `device` (None: the CPU): load, prefill, decode one row, decode `rows` rows."""
    cfg = load_config(path)
    t0 = time.perf_counter()
    e = GgmlEngine(path, Shard.whole("m", cfg.n_layers), cfg, threads=threads, adapt_threads=False, device=device)
    out = {"device": device or "CPU", "load_s": time.perf_counter() - t0}
    rng = np.random.default_rng(0)
    ids = rng.integers(300, cfg.vocab_size, prompt + steps + 8)

    def step(batch: list[StepInput]) -> float:
        t = time.perf_counter()
        e.forward(batch)
        return time.perf_counter() - t

    step([StepInput("warm", tokens=ids[:64], max_positions=128)])  # graphs built, buffers sized
    for k in range(4):
        step([StepInput("warm", tokens=ids[64 + k : 65 + k])])
    e.release("warm")
    took = step([StepInput("p", tokens=ids[:prompt], max_positions=prompt + steps + 8)])
    out["prefill_tok_s"] = prompt / took
    one = [step([StepInput("p", tokens=ids[prompt + k : prompt + k + 1])]) for k in range(steps)]
    out["decode_ms"] = 1000 * statistics.median(one)
    e.release("p")
    names = [f"r{i}" for i in range(rows)]
    step([StepInput(n, tokens=ids[i : i + 32], max_positions=32 + steps + 1) for i, n in enumerate(names)])
    many = [
        step([StepInput(n, tokens=ids[32 + i + k : 33 + i + k]) for i, n in enumerate(names)]) for k in range(steps)
    ]
    out[f"decode_{rows}_tok_s"] = rows / statistics.median(many)
    for n in names:
        e.release(n)
    out["batch_diff"] = batch_difference(e, ids, rows)
    out["fallbacks"] = dict(e.on.fallbacks) if e.on is not None else {}
    e.close()
    return out


def batch_difference(e: GgmlEngine, ids: np.ndarray, rows: int) -> float:
    """The largest logit difference between a decode row computed alone and the same row among `rows - 1` others
    (0.0: batch invariant on this device)."""
    for n in ("solo", "mixed"):
        e.forward([StepInput(n, tokens=ids[:40], max_positions=48)])
    alone = e.forward([StepInput("solo", tokens=ids[40:41])])[0]
    others = [StepInput(f"o{i}", tokens=ids[i + 1 : i + 41], max_positions=48) for i in range(rows - 1)]
    e.forward(others)
    beside = e.forward(
        [StepInput("mixed", tokens=ids[40:41]), *(StepInput(o.request_id, tokens=ids[:1]) for o in others)]
    )
    for n in ("solo", "mixed", *(o.request_id for o in others)):
        e.release(n)
    return float(np.abs(alone - beside[0]).max())


def node_decode_ms(path: Path, device: str, threads: int, tokens: int = 64) -> float:
    """Per generated token through a whole exo-node process (HTTP, core, sampling; greedy, one request): the
    time of a `tokens + 1`-token answer less a 1-token one, over `tokens`."""
    from bench.local_cluster import Cluster

    extra = ["--threads", str(threads), "--quantize", "none"]
    with Cluster(path, 1, model_id=path.stem, engine="ggml", per_node=[["--device", device]], extra=extra) as c:
        took = {}
        for n in (1, tokens + 1, 1, tokens + 1):  # the second pair is measured, the first warms up
            t = time.perf_counter()
            status, body = c.chat("Count to a hundred.", max_tokens=n, temperature=0)
            assert status == 200 and body["usage"]["completion_tokens"] == n, body
            took[n] = time.perf_counter() - t
    return 1000 * (took[tokens + 1] - took[1]) / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--device", default="auto", help="the GPU device (a name or a backend; default: the fastest)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the CPU engine's threads")
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("EXO_BENCH_CACHE", "/tmp/exo-bench")))
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--node", action="store_true", help="also the decode time through a whole node on each device")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    path = model(args.shape, args.cache)
    runs = [measure(path, args.device, args.prompt, args.steps, args.rows, args.threads)]
    if not args.skip_cpu:
        runs.append(measure(path, None, args.prompt, args.steps, args.rows, args.threads))
    if args.node:
        for r in runs:
            r["node_decode_ms"] = node_decode_ms(path, "cpu" if r["device"] == "CPU" else args.device, args.threads)
    key = f"decode_{args.rows}_tok_s"
    print(
        f"random {args.shape} Llama, F16, prompt {args.prompt}, {args.steps} decode steps, CPU threads {args.threads}"
    )
    print(
        f"{'device':<10} {'load s':>7} {'prefill tok/s':>14} {'decode ms/tok':>14} {f'{args.rows} rows tok/s':>14}"
        f" {'node ms/tok':>12} {'batch diff':>11}"
    )
    for r in runs:
        node = f"{r['node_decode_ms']:>12.2f}" if "node_decode_ms" in r else f"{'-':>12}"
        print(
            f"{r['device']:<10} {r['load_s']:>7.1f} {r['prefill_tok_s']:>14.0f} {r['decode_ms']:>14.2f} {r[key]:>14.0f}"
            f" {node} {r['batch_diff']:>11.2e}"
        )
    print(f"ops on the CPU instead of the device: {runs[0]['fallbacks'] or 'none'}")
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
