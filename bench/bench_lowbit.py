"""Low-bit GGUF types on the ggml engine against llama.cpp on the same files, and the packaged default (SmolLM2
requantized to F16 on load) against its file's own Q4_1.

    uv run python -m bench.bench_lowbit --llama-python /tmp/ref/venv/bin/python \
        --llama-env LLAMA_CPP_LIB_PATH=/tmp/ref/llama.cpp/build/bin,PYTHONPATH=/tmp/ref/llama_cpp_python-0.3.36

Types: bench's random 357.6M Llama (bench/ggml_models.py) as Q2_K, Q3_K_M and IQ4_XS (in outline of llama-quantize's
recipes). Each figure: decode (batch 1, median step), prefill (256 tokens, best warm run), both runtimes in fresh
processes, same file, same threads, alternating rounds. llama.cpp: bench/llamacpp_ref.py (llama-cpp-python's code
over a libllama built from the same sdist), flash attention on, its default buffers (repacked where it can, as
exo-node's engine does). The packaged default: load seconds, resident memory after load,
decode tok/s and greedy answers to the README's questions, `--quantize f16` vs the file's Q4_1 (`none`).
Prints one JSON object and writes it to --out. Speed goals live here, never in timed test asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "bench" / "llamacpp_ref.py"
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]


def run_json(cmd: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, env={**os.environ, **env})
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ours_speed(path: Path, threads: int) -> dict:
    return run_json(
        [sys.executable, "-m", "bench.bench_ggml", "--ours", "speed", str(path), str(threads)],
        {"PYTHONPATH": str(ROOT)},
    )


def theirs_speed(python: str, env: dict[str, str], path: Path, threads: int) -> dict:
    return run_json([python, str(REF), "speed", str(path), "--threads", str(threads)], env)


def default_model(quantize: str) -> dict:
    """In this (fresh) process: the packaged SmolLM2 on ggml with `quantize`."""
    import numpy as np

    from shards.engines.base import StepInput
    from shards.engines.ggml.engine import GgmlEngine
    from shards.formats.loader import load_config
    from shards.formats.packaged import resolve_model
    from shards.formats.tokenizer import Tokenizer
    from shards.model.shard import Shard
    from shards.reference.generate import generate

    path = resolve_model("smollm2")[0]
    cfg, tok = load_config(path), Tokenizer.load(path)
    t0 = time.perf_counter()
    e = GgmlEngine(path, Shard.whole("smollm2", cfg.n_layers), cfg, quantize=quantize)
    load_s = time.perf_counter() - t0
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    answers = []
    for q in QUESTIONS:
        ids = [
            r.token
            for r in generate(
                [e], tok.encode_chat([{"role": "user", "content": q}]), 60, eos_ids=frozenset(cfg.eos_token_ids)
            )
        ]
        answers.append(tok.decode(ids))
    e.forward([StepInput("d", tokens=np.arange(100, 164), max_positions=512)])
    steps, t = [], 100
    for _ in range(48):
        t1 = time.perf_counter()
        t = int(e.forward([StepInput("d", tokens=np.array([t]))])[0][-1].argmax())
        steps.append(time.perf_counter() - t1)
    steps.sort()
    return {
        "quantize": quantize,
        "load_s": load_s,
        "rss_after_load_mb": rss / 2**20,
        "weights_mb": e.nbytes() / 2**20,
        "decode_tok_s": 1 / steps[len(steps) // 2],
        "answers": answers,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", help="a python that can import llama_cpp (see bench/llamacpp_ref.py)")
    ap.add_argument("--llama-env", default="", help="NAME=VALUE,... for that python (library and module paths)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--types", default="q2_k,q3_k_m,iq4_xs")
    ap.add_argument("--only", default="types,default")
    ap.add_argument("--out", type=Path, default=Path("bench-lowbit.json"))
    ap.add_argument("--default-model", help=argparse.SUPPRESS)  # the child process of the default-model figures
    args = ap.parse_args()
    if args.default_model:
        print(json.dumps(default_model(args.default_model)))
        return
    env = dict(kv.split("=", 1) for kv in args.llama_env.split(",") if kv)
    result: dict = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "threads": args.threads,
        "load_before": os.getloadavg()[0],
        "types": {},
        "default": [],
    }
    if "types" in args.only:
        from bench.ggml_models import random_gguf

        for kind in args.types.split(","):
            path = random_gguf(kind)
            rows = []
            for _ in range(args.rounds):
                rows.append(
                    {
                        "ours": ours_speed(path, args.threads),
                        "llama_cpp": theirs_speed(args.llama_python, env, path, args.threads),
                        "load": os.getloadavg()[0],
                    }
                )
            best = {
                who: {k: max(r[who][k] for r in rows) for k in ("decode1", "prefill256")}
                for who in ("ours", "llama_cpp")
            }
            result["types"][kind] = {
                "rounds": rows,
                "best": best,
                "ratio": {k: best["ours"][k] / best["llama_cpp"][k] for k in ("decode1", "prefill256")},
            }
    if "default" in args.only:
        for quantize in ("f16", "none"):
            result["default"].append(
                run_json(
                    [sys.executable, "-m", "bench.bench_lowbit", "--default-model", quantize], {"PYTHONPATH": str(ROOT)}
                )
            )
    result["load_after"] = os.getloadavg()[0]
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
