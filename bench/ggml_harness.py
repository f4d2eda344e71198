"""How bench/bench_ggml.py (and bench/bench_moe.py) run each side: our engine built in this process, and every
measurement in a fresh process, ours (`python -m bench.bench_ggml --ours ...`) or llama.cpp's (bench/llamacpp_ref.py
under the venv that has llama-cpp-python), each answering one JSON line. A fresh process per figure keeps one
measurement's memory, caches and threads out of the next one's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from shards.formats.loader import load_config
from shards.model.shard import Shard

ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "bench" / "llamacpp_ref.py"


def engine(path: Path, threads: int, start: int = 0, end: int | None = None, name: str = "ggml"):
    from shards.engines.registry import engine_class

    cfg = load_config(path)
    shard = Shard("m", start, end or cfg.n_layers, cfg.n_layers)
    return engine_class(name)(path, shard, cfg, **({"threads": threads} if name == "ggml" else {}))


def run_json(cmd: list[str]) -> dict:
    out = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ours(*args) -> dict:
    return run_json([sys.executable, "-m", "bench.bench_ggml", "--ours", *map(str, args)])


def theirs(llama_python: str, *args) -> dict:
    return run_json([llama_python, str(REF), *map(str, args)])


def load() -> float:
    return os.getloadavg()[0]
