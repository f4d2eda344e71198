"""Agreement with llama.cpp along the default engine's own greedy path: `python -m bench.bench_agreement greedy`.

Per model and prompt, the ggml engine as a node builds it (its defaults: CPU_REPACK on, `pad` float matmuls) continues
the prompt greedily, one decode step per token, keeping each step's logits; llama.cpp (bench/llamacpp_ref.py on the same
file, in its own python, as it ships) is then teacher-forced along prompt + continuation in batches of 32. At each
continuation position both "pick" a token: the engine the one it generated, llama.cpp its argmax there. A disagreement's
`margin` is llama.cpp's logit of its own pick minus its logit of the engine's: under NEAR_TIE the two tokens are tied as
far as llama.cpp's own kernels can tell (its two kernel sets split at leads of that order: bench_agreement
`near_tie_threshold`), over it the engine chose a token llama.cpp clearly ranks lower. `ours_margin` is the same lead in
the engine's logits (its pick over llama.cpp's), so a disagreement both sides call close reads apart from one side's
error. Where a mixture of experts disagrees past NEAR_TIE, every position gets `router_gap` (router_gaps): how close
the float computation's routers were to choosing other experts there. `--self-check` adds llama.cpp against itself
(one row a decode, as it serves, against its batches of 32: `llama_self_agree`, its own near-tie scale) and the
engine against llama.cpp decoding (`agree_with_llama_decoding`). `--attention` sets the ggml backend's attention
kernel where it has a choice (its flash attention is llama.cpp's, so only it can be bit-identical). Prints one JSON
line per model, then a table (docs/correctness.md, "Agreement with llama.cpp", has the figures).
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

from shards.reference.generate import chain_forward

ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "bench" / "llamacpp_ref.py"
FIXTURES = ROOT / "tests" / "fixtures"
NEAR_TIE = 0.05
SMALL_MOE = dict(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, experts=8, used=2, expert_ff=256, vocab=2000)


def model_files(which: list[str]) -> dict[str, Path]:
    from bench.moe_model import as_float32, random_qwen3moe

    out: dict[str, Path] = {}
    for name in which:
        if name == "smollm2":
            from shards.formats.packaged import resolve_model

            out["smollm2-q4_1"] = Path(resolve_model("smollm2")[0])
        elif name in ("gemma2", "gemma3"):
            out[f"{name}-f16"] = FIXTURES / "gemma" / f"{name}.gguf"
        elif name in ("qwen3moe", "mixtral", "qwen2moe"):
            out[f"{name}-f32"] = as_float32(FIXTURES / "moe" / f"{name}.gguf")
            if name == "qwen3moe":
                out["qwen3moe-q8_0"] = FIXTURES / "moe" / "qwen3moe.q8_0.gguf"
        elif name == "moe-q4_k":
            out["random-qwen3moe-q4_k"] = random_qwen3moe(**SMALL_MOE)
        elif name.endswith(".gguf") and Path(name).is_file():  # any file both sides load, e.g. a real model
            out[Path(name).stem] = Path(name)
        else:
            raise SystemExit(
                f"unknown model {name!r}: smollm2, gemma2, gemma3, qwen3moe, mixtral, qwen2moe, moe-q4_k, or a .gguf file"
            )
    return out


KNOWN = {
    "gemma2-f16",
    "gemma3-f16",
    "qwen3moe-f32",
    "qwen3moe-q8_0",
    "mixtral-f32",
    "qwen2moe-f32",
    "random-qwen3moe-q4_k",
}


def prompts(name: str, path: Path, count: int, length: int) -> list[list[int]]:
    """Real text for a real model (bench_ggml.TEXTS, one text a prompt), random ids for the random fixtures."""
    if name.startswith("smollm2") or name not in KNOWN:
        from bench.bench_ggml import TEXTS
        from shards.formats.tokenizer import Tokenizer

        tok = Tokenizer.load(path)
        return [list(tok.encode(t))[:length] for t in TEXTS[:count]]
    from shards.formats.loader import load_config

    vocab = load_config(path).vocab_size
    return [np.random.default_rng(100 + i).integers(3, vocab, length).tolist() for i in range(count)]


def engine(path: Path, threads: int):
    """The ggml engine on the whole model, with the defaults a node uses."""
    from shards.engines.ggml.engine import GgmlEngine
    from shards.formats.loader import load_config
    from shards.model.shard import Shard

    cfg = load_config(path)
    return GgmlEngine(path, Shard("m", 0, cfg.n_layers, cfg.n_layers), cfg, threads=threads)


def ours_greedy(e, rid: str, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """(the engine's n greedy tokens, the logits [n, vocab] each was chosen from): the prompt in one step, then one
    token a step, as a node serves a request."""
    from shards.engines.base import StepInput

    tokens, rows, feed = [], [], np.asarray(prompt, dtype=np.int64)
    for _ in range(n):
        row = e.forward([StepInput(rid, tokens=feed, max_positions=len(prompt) + n)])[0].reshape(-1)
        rows.append(row.astype(np.float32))
        tokens.append(int(row.argmax()))
        feed = np.array([tokens[-1]], dtype=np.int64)
    e.release(rid)
    return tokens, np.stack(rows)


def llama_logits(args, path: Path, ids: list[int], work: Path, chunk: int = 32) -> np.ndarray:
    env = dict(kv.split("=", 1) for kv in args.llama_env.split(",") if kv)
    (work / "ids.json").write_text(json.dumps(ids))
    cmd = [
        args.llama_python,
        str(REF),
        "logits",
        str(path),
        "--threads",
        str(args.threads),
        "--all",
        "--chunk",
        str(chunk),
    ]
    cmd += ["--tokens", str(work / "ids.json"), "--out", str(work / "ref.npz")]
    cmd += ["--no-extra-bufts"] if args.llama_plain else []
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600, env={**os.environ, **env})
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return np.load(work / "ref.npz")["logits"]


def compare(prompt_index: int, start: int, picks: list[int], ours: np.ndarray, ref: np.ndarray) -> list[dict]:
    """One row per continuation position: both picks, and the leads (0 where they agree)."""
    rows = []
    for j, (mine, o, r) in enumerate(zip(picks, ours, ref)):
        theirs = int(r.argmax())
        rows.append(
            {
                "prompt": prompt_index,
                "position": start + j,
                "ours": mine,
                "llama": theirs,
                "margin": round(float(r[theirs] - r[mine]), 5),
                "ours_margin": round(float(o[mine] - o[theirs]), 5),
            }
        )
    return rows


def router_gaps(path: Path, ids: list[int]) -> np.ndarray | None:
    """Per position, the smallest lead over all layers of the k-th chosen expert's router logit over the best expert
    left out, in the float (numpy engine) computation of the path; None for a dense model. Under the logits' rounding
    noise a router is itself at a tie: a kernel's last bits pick the other expert and move the logits by far more
    than any rounding (a "routing flip")."""
    from shards.engines.numpy_engine import NumpyEngine
    from shards.formats.loader import load_config
    from shards.model.shard import Shard

    cfg = load_config(path)
    if cfg.moe is None:
        return None
    e = NumpyEngine(path, Shard("m", 0, cfg.n_layers, cfg.n_layers), cfg)
    seen, moe = [], e.model.ops.moe

    def recording(x, router_logits, *rest):
        top = -np.sort(-np.asarray(router_logits, np.float64), axis=-1)
        seen.append(top[:, cfg.moe.n_used - 1] - top[:, cfg.moe.n_used])
        return moe(x, router_logits, *rest)

    e.model.ops.moe = recording
    chain_forward([e], "gaps", np.asarray(ids), all_logits=True)
    return np.min(seen, axis=0)


def measure(args, name: str, path: Path, work: Path) -> dict:
    rows, own, decoded, paths, e = [], [], [], [], engine(path, args.threads)
    try:
        for i, prompt in enumerate(prompts(name, path, args.prompts, args.prompt_len)):
            paths.append((prompt, *ours_greedy(e, f"r{i}", prompt, args.n)))
    finally:
        e.close()
    for i, (prompt, picks, ours) in enumerate(paths):
        ref = llama_logits(args, path, prompt + picks, work)[len(prompt) - 1 : len(prompt) - 1 + args.n]
        found = compare(i, len(prompt), picks, ours, ref)
        if args.self_check:  # llama.cpp against itself: one row a decode, as it serves, against batches of 32
            alone = llama_logits(args, path, prompt + picks, work, 1)[len(prompt) - 1 : len(prompt) - 1 + args.n]
            own += compare(i, len(prompt), [int(r.argmax()) for r in alone], alone, ref)
            decoded += compare(i, len(prompt), picks, ours, alone)
        if any(r["margin"] >= NEAR_TIE for r in found) and (gaps := router_gaps(path, prompt + picks)) is not None:
            for r in found:
                r["router_gap"] = round(float(gaps[r["position"] - 1]), 5)
        rows += found
    off, self_off, decode_off = ([r for r in x if r["ours"] != r["llama"]] for x in (rows, own, decoded))
    baseline = {
        "agree_with_llama_decoding": round(1 - len(decode_off) / max(len(decoded), 1), 4),
        "llama_self_agree": round(1 - len(self_off) / max(len(own), 1), 4),
        "llama_self_worst_margin": max((r["margin"] for r in self_off), default=0.0),
    }
    return {
        "model": name,
        "file": str(path),
        "positions": len(rows),
        "agree": round(1 - len(off) / len(rows), 4),
        "worst_margin": max((r["margin"] for r in off), default=0.0),
        "all_near_ties": all(r["margin"] < NEAR_TIE for r in off),
        **(baseline if own else {}),
        "disagreements": off,
    }


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="bench.bench_agreement greedy", description=__doc__)
    ap.add_argument("--llama-python", required=True, help="a python that imports llama_cpp")
    ap.add_argument("--llama-env", default="", help="NAME=VALUE,... for that python (library and module paths)")
    ap.add_argument("--models", default="smollm2,gemma2,gemma3,qwen3moe,mixtral,moe-q4_k")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--n", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--attention", choices=["flash", "gemm", "auto"], help="the ggml attention module's ATTENTION")
    ap.add_argument(
        "--llama-plain",
        action="store_true",
        help="llama.cpp's weights out of its repacked buffers (as exo's plain ones)",
    )
    ap.add_argument("--self-check", action="store_true", help="also llama.cpp decoding alone vs in batches of 32")
    args = ap.parse_args(argv)
    if args.attention:
        import shards.engines.ggml.attention as attention

        if not hasattr(attention, "ATTENTION"):
            raise SystemExit("this ggml backend has one attention (flash): drop --attention")
        attention.ATTENTION = args.attention
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in model_files(args.models.split(",")).items():
            results.append(measure(args, name, path, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    print(
        f"\n{'model':<22} {'positions':>9} {'agree':>7} {'disagree':>8} {'worst margin':>12}  near-ties only  llama.cpp self"
    )
    for r in results:
        n_off = len(r["disagreements"])
        own = f"{r['llama_self_agree']:.2%} / {r['llama_self_worst_margin']:.4f}" if "llama_self_agree" in r else "-"
        print(
            f"{r['model']:<22} {r['positions']:>9} {r['agree']:>7.2%} {n_off:>8} {r['worst_margin']:>12.4f}  "
            f"{'yes' if r['all_near_ties'] else 'NO ':<14}  {own}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
