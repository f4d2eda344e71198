"""Teacher-forced top-1 agreement of the ggml engine with llama.cpp on the same GGUF files, with the reference's
margin (top-1 minus top-2 logit) at the disagreements, so a disagreement at a near-tie (below the rounding noise of
llama.cpp's own kernels) reads apart from a bug.

    uv run python -m bench.bench_agreement --llama-python /tmp/ref/venv/bin/python --llama-env \
        LLAMA_CPP_LIB_PATH=/tmp/ref/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin,PYTHONPATH=/tmp/ref/llama_cpp_python-0.3.36

Two modes (MODES): each side as it ships, and both on the same kernels (no CPU_REPACK buffers, llama.cpp's tiled
K-quant matmul off: bench/ggml_kernels_diff.py shows it is the one kernel this llama.cpp build has that exo-node's
ggml lacks). Both sides see the same ids in batches of the same size (`--chunks`, default 32 = the ggml engine's
ATTENTION_ROWS): ggml's CPU flash attention takes another kernel from 64 query rows on, so llama.cpp fed 600 rows
at once is not the computation exo-node runs (`--chunks 600` shows that case). Models: the packaged SmolLM2-135M
Q4_1 (its own bytes, real text) and bench/moe_model.py's random Qwen3-MoE in Q4_K (random ids). Each side runs in
a fresh process; ~3 minutes on 2 cores. Prints one JSON line per model, chunk size and mode.

`greedy` (bench/agreement_greedy.py): the same comparison along the default engine's own greedy continuations of a
few prompts per model (SmolLM2 Q4_1, the Gemma 2/3 fixtures, the MoE fixtures in F32 and Q8_0, a small random
Qwen3-MoE in Q4_K), reporting every disagreement's margin in llama.cpp's logits:

    uv run python -m bench.bench_agreement greedy --llama-python /tmp/llamavenv/bin/python --llama-env ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "bench" / "llamacpp_ref.py"


def ours_logits(path: str, ids_file: str, out: str, chunk: int, repack: bool) -> dict:
    """Every position's logits from the ggml engine, the ids fed `chunk` at a time to one request."""
    from shards.engines.base import StepInput
    from shards.engines.ggml.engine import GgmlEngine
    from shards.formats.loader import load_config
    from shards.model.shard import Shard

    ids = np.asarray(json.loads(Path(ids_file).read_text()), dtype=np.int64)
    cfg = load_config(Path(path))
    shard = Shard("m", 0, cfg.n_layers, cfg.n_layers)
    e = GgmlEngine(path, shard, cfg, threads=os.cpu_count() or 1, repack=repack)
    rows = [
        e.forward([StepInput("r", tokens=ids[s : s + chunk], max_positions=len(ids))], all_logits=True)[0]
        for s in range(0, len(ids), chunk)
    ]
    np.save(out, np.concatenate(rows).astype(np.float32))
    return {"positions": len(ids)}


def compare(ours: np.ndarray, ref: np.ndarray, tau: float) -> dict:
    """Top-1 agreement and where it fails: the reference's lead of its own top token at each disagreement, and the
    agreement over the positions whose lead is at least `tau` (near_tie_threshold)."""
    top_o, order = ours.argmax(-1), np.argsort(-ref, axis=-1)[:, :2]
    margin = ref[np.arange(len(ref)), order[:, 0]] - ref[np.arange(len(ref)), order[:, 1]]
    same = top_o == order[:, 0]
    diff = np.abs(ours - ref)
    return {
        "positions": len(same),
        "agree": round(float(same.mean()), 4),
        "near_tie_threshold": round(tau, 4),
        "positions_over_threshold": int((margin >= tau).sum()),
        "agree_over_threshold": round(float(same[margin >= tau].mean()), 4),
        "first_disagreement": int(np.argmin(same)) if not same.all() else None,
        "disagreements": int((~same).sum()),
        "largest_disagreement_margins": sorted(np.round(margin[~same], 4).tolist())[-5:],
        "ref_margin_p05": round(float(np.quantile(margin, 0.05)), 4),
        "max_abs_diff": round(float(diff.max()), 5),
        "p99_abs_diff": round(float(np.quantile(diff.max(-1), 0.99)), 5),
        "position0_max_abs_diff": round(float(diff[0].max()), 7),
    }


def run_json(cmd: list[str], env: dict) -> dict:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, env={**os.environ, **env})
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def models(which: list[str]) -> dict[str, tuple[Path, list[int]]]:
    from bench.bench_ggml import TEXTS
    from shards.formats.loader import load_config

    out = {}
    if "smollm2" in which:
        from shards.formats.packaged import resolve_model
        from shards.formats.tokenizer import Tokenizer

        path = resolve_model("smollm2")[0]
        tok = Tokenizer.load(path)
        out["smollm2-q4_1"] = path, [t for text in TEXTS for t in tok.encode(text)][:600]
    if "moe" in which:
        from bench.moe_model import random_qwen3moe

        path = random_qwen3moe()
        out["random-qwen3moe-q4_k"] = path, np.random.default_rng(7).integers(3, load_config(path).vocab_size, 600)
    return {k: (p, [int(t) for t in ids]) for k, (p, ids) in out.items()}


MODES = {  # name: (llama.cpp's extra flags and environment, exo's weight placement)
    "default": ([], {}, "repack"),  # each side as it ships
    # the same kernels on both sides: no CPU_REPACK buffers, and llama.cpp's tiled K-quant matmul off (a kernel the
    # ggml in exo-node's ggml-python wheel does not have; bench/ggml_kernels_diff.py)
    "same-kernels": (["--no-extra-bufts"], {"GGML_CPU_TILED_MM": "0"}, "plain"),
}


def near_tie_threshold(refs: dict[str, np.ndarray]) -> float:
    """llama.cpp's own rounding noise on this model, in the units of a reference's lead: the largest lead (top-1
    minus top-2 logit, in its default mode) at which llama.cpp's two kernel sets (MODES) pick different tokens. A
    lead below it is a tie as far as llama.cpp itself can tell, so a disagreement there says nothing about exo-node."""
    a, b = refs["default"], refs["same-kernels"]
    split = a.argmax(-1) != b.argmax(-1)
    top2 = -np.sort(-a, axis=-1)[:, :2]
    return float((top2[:, 0] - top2[:, 1])[split].max()) if split.any() else 0.0


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "greedy":
        from bench.agreement_greedy import main as greedy_main

        greedy_main(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--ours":  # one side's measurement, in this fresh process
        print(json.dumps(ours_logits(*sys.argv[2:5], int(sys.argv[5]), sys.argv[6] == "repack")))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True, help="a python that imports llama_cpp")
    ap.add_argument("--llama-env", default="", help="NAME=VALUE,... for that python (library and module paths)")
    ap.add_argument("--models", default="smollm2,moe")
    ap.add_argument("--chunks", default="32", help="batch sizes to feed both sides (600: one batch)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    env = dict(kv.split("=", 1) for kv in args.llama_env.split(",") if kv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, (path, ids) in models(args.models.split(",")).items():
            ids_file = work / "ids.json"
            ids_file.write_text(json.dumps(ids))
            for chunk in map(int, args.chunks.split(",")):
                refs, ours = {}, {}
                for mode, (flags, mode_env, placement) in MODES.items():
                    ref_out, our_out = work / f"ref-{mode}.npz", work / f"ours-{mode}.npy"
                    run_json(
                        [args.llama_python, str(REF), "logits", str(path), "--threads", str(args.threads), "--all"]
                        + ["--tokens", str(ids_file), "--out", str(ref_out), "--chunk", str(chunk), *flags],
                        env | mode_env,
                    )
                    run_json(
                        [sys.executable, "-m", "bench.bench_agreement", "--ours", str(path), str(ids_file)]
                        + [str(our_out), str(chunk), placement],
                        {"PYTHONPATH": str(ROOT)},
                    )
                    refs[mode], ours[mode] = np.load(ref_out)["logits"], np.load(our_out)
                tau = near_tie_threshold(refs)
                for mode in MODES:
                    row = {"model": name, "chunk": chunk, "mode": mode, **compare(ours[mode], refs[mode], tau)}
                    print(json.dumps(row | {"load": round(os.getloadavg()[0], 2)}), flush=True)
                row = {"model": name, "chunk": chunk, "mode": "llama.cpp default vs same-kernels"}
                print(json.dumps(row | compare(refs["same-kernels"], refs["default"], tau)), flush=True)


if __name__ == "__main__":
    main()
