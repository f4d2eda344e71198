"""A 7B-shaped Llama with random weights as Q4_K_M, for serving a model no one node can hold
(bench/bench_multihost_large.py).

Llama-3-8B's body (hidden 4096, 32 layers, 32 heads / 8 KV heads, feed-forward 14336) on bench/ggml_models.py's
32000-piece vocabulary (so both exo-node and llama.cpp load it without a BPE tokenizer): 7.24B parameters. Written
as F16 one tensor at a time (never the whole model in memory), then quantized by llama.cpp's own `llama-quantize
Q4_K_M` (its recipe: Q4_K, with Q6_K for some attention-value and feed-forward-down matrices and the output
head), the F16 file removed after. Random values need no Q/K permutation: both runtimes read the same file.

    uv run --group bench python -m bench.large_model      # -> ~/.cache/exo-node-bench/random7b-q4_k_m.gguf
    uv run --group bench python -m bench.large_model --layers 4   # -> .../random7b-4l-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np

from bench.bench_rpc import LLAMACPP_BIN
from bench.ggml_models import CACHE, llama_header

LARGE = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=32000,
)
Q4_OF_F16 = 0.32  # Q4_K_M's bytes over F16's (4.5-4.9 bits a weight over 16), with room: for the disk check


def tensor_shapes(s: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama of shape `s` by GGUF name, with its numpy shape (rows, columns), in file order."""
    h, inter, vocab = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    kv = s["num_key_value_heads"] * (h // s["num_attention_heads"])
    yield "token_embd.weight", (vocab, h)
    for i in range(s["num_hidden_layers"]):
        yield from (
            (f"blk.{i}.attn_norm.weight", (h,)),
            (f"blk.{i}.attn_q.weight", (h, h)),
            (f"blk.{i}.attn_k.weight", (kv, h)),
            (f"blk.{i}.attn_v.weight", (kv, h)),
            (f"blk.{i}.attn_output.weight", (h, h)),
            (f"blk.{i}.ffn_norm.weight", (h,)),
            (f"blk.{i}.ffn_gate.weight", (inter, h)),
            (f"blk.{i}.ffn_up.weight", (inter, h)),
            (f"blk.{i}.ffn_down.weight", (h, inter)),
        )
    yield "output_norm.weight", (h,)
    yield "output.weight", (vocab, h)


def f16_bytes(s: dict) -> int:
    """The F16 file's tensor bytes (norms stay F32)."""
    return sum(int(np.prod(shape)) * (4 if len(shape) == 1 else 2) for _, shape in tensor_shapes(s))


def random_tensor(shape: tuple[int, ...], pool: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Norms are ones (F32); a matrix is F16 normal / sqrt(fan-in), so activations keep their scale layer to layer:
    a window at a random offset of `pool` (standard normal values, at least as many as the largest matrix), since
    drawing all 7B values one by one costs minutes of CPU and changes nothing a benchmark measures."""
    if len(shape) == 1:
        return np.ones(shape, np.float32)
    n = int(np.prod(shape))
    at = int(rng.integers(0, pool.size - n + 1))
    return (pool[at : at + n] * np.float32(shape[-1] ** -0.5)).astype(np.float16).reshape(shape)


def write_f16(path: Path, s: dict, seed: int = 0) -> Path:
    """The F16 GGUF of a random Llama of shape `s`, written one tensor at a time."""
    shapes = list(tensor_shapes(s))
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal(max(int(np.prod(x)) for _, x in shapes) * 5 // 4, dtype=np.float32)
    w = gguf.GGUFWriter(str(path), "llama")
    llama_header(w, f"random {sum(int(np.prod(x)) for _, x in shapes) / 1e9:.2f}B Llama", s)
    for name, shape in shapes:
        dtype = np.float32 if len(shape) == 1 else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, shape in shapes:
        w.write_tensor_data(random_tensor(shape, pool, rng))
    w.close()
    return path


def large_gguf(bin_dir: Path = LLAMACPP_BIN, seed: int = 0, threads: int | None = None, layers: int = 32) -> Path:
    """The Q4_K_M file (made once, then reused from the cache); `layers`: of the 32, the first this many (the same
    matrices at a fraction of the size, for one node's kernels: docs/benchmarks.md, "A 7B-shaped Q4_K_M")."""
    if not 1 <= layers <= LARGE["num_hidden_layers"]:
        raise SystemExit(f"layers: 1 to {LARGE['num_hidden_layers']}, not {layers}")
    shape = dict(LARGE, num_hidden_layers=layers)
    path = CACHE / (
        "random7b-q4_k_m.gguf" if layers == LARGE["num_hidden_layers"] else f"random7b-{layers}l-q4_k_m.gguf"
    )
    if path.exists():
        return path
    quantize = bin_dir / "llama-quantize"
    if not quantize.exists():
        raise SystemExit(f"{quantize} is missing: build llama.cpp (docs/benchmarks.md) or pass its build/bin folder")
    CACHE.mkdir(parents=True, exist_ok=True)
    need, free = f16_bytes(shape) * (1 + Q4_OF_F16), shutil.disk_usage(CACHE).free
    if free < need:
        raise SystemExit(
            f"{CACHE} has {free / 2**30:.1f} GiB free, making the model needs {need / 2**30:.1f} GiB: free some, or "
            "point EXO_BENCH_CACHE at a larger disk"
        )
    f16, tmp = path.with_suffix(".f16.partial"), path.with_suffix(".partial")
    try:
        write_f16(f16, shape, seed)
        cmd = [str(quantize), str(f16), str(tmp), "Q4_K_M", str(threads or os.cpu_count() or 1)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        tmp.rename(path)
    finally:
        f16.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llamacpp-bin", type=Path, default=LLAMACPP_BIN, help="llama.cpp's build/bin folder")
    ap.add_argument("--threads", type=int, help="llama-quantize's threads (default: every core)")
    ap.add_argument("--layers", type=int, default=LARGE["num_hidden_layers"], help="the first this many layers")
    args = ap.parse_args()
    print(large_gguf(args.llamacpp_bin, threads=args.threads, layers=args.layers))
