"""The ggml engine against llama.cpp on one mixture-of-experts file (bench/moe_model.py's random Qwen3-MoE, Q4_K):
teacher-forced top-1 agreement (also llama.cpp against itself with and without its repacked weights, which
says how close to ties the model's logits sit), decode and prefill speed on the same threads, and the resident
memory of a node holding a third of the layers against those tensors' bytes in the file.

    uv run python -m bench.bench_moe --llama-python /tmp/llamavenv/bin/python [--threads 2]

llama.cpp runs through bench/llamacpp_ref.py in its own venv; our side in fresh processes (bench/bench_ggml.py's
--ours commands). Prints one JSON object per measurement, with the 1-minute load average.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from bench.ggml_harness import load, ours, theirs
from bench.moe_model import random_qwen3moe
from shards.formats.loader import load_config


def agreement(path: Path, llama: str, work: Path, threads: int) -> dict:
    cfg = load_config(path)
    ids = work / "ids.json"
    ids.write_text(json.dumps(np.random.default_rng(7).integers(3, cfg.vocab_size, 600).tolist()))
    theirs(llama, "logits", path, "--threads", threads, "--tokens", ids, "--out", work / "llama.npz")
    theirs(
        llama,
        "logits",
        path,
        "--threads",
        threads,
        "--no-extra-bufts",
        "--tokens",
        ids,
        "--out",
        work / "llama_plain.npz",
    )
    for engine in ("ggml", "numpy"):
        ours("top", path, ids, engine, work / f"{engine}.npz")
    top = {k: np.load(work / f"{k}.npz")["ids"][:, 0] for k in ("llama", "llama_plain", "ggml", "numpy")}
    return {
        f"{a}_vs_{b}": float((top[a] == top[b]).mean())
        for a, b in [
            ("ggml", "llama"),
            ("ggml", "llama_plain"),
            ("llama", "llama_plain"),
            ("ggml", "numpy"),
            ("llama", "numpy"),
        ]
    } | {"positions": len(top["ggml"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True, help="python of a venv with llama-cpp-python")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    path = random_qwen3moe()
    cfg = load_config(path)
    third = cfg.n_layers // 3
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps({"agreement": agreement(path, args.llama_python, Path(tmp), args.threads), "load": load()}))
    print(json.dumps({"ours": ours("speed", path, args.threads), "load": load()}))
    print(json.dumps({"llama": theirs(args.llama_python, "speed", path, "--threads", args.threads), "load": load()}))
    print(
        json.dumps(
            {
                "llama_plain": theirs(args.llama_python, "speed", path, "--threads", args.threads, "--no-extra-bufts"),
                "load": load(),
            }
        )
    )
    print(json.dumps({"memory_middle_third": ours("memory", path, third, 2 * third), "load": load()}))


if __name__ == "__main__":
    main()
