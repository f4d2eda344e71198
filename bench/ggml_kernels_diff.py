"""One op at a time, the same inputs through two ggml libraries: exo-node's (the `ggml-python` wheel's libggml) and
the one llama.cpp was built with. Says which kernels give other bits, so a gap in teacher-forced agreement
(bench/bench_agreement.py) can be put on the ops that make it, rather than guessed from logits.

    uv run python -m bench.ggml_kernels_diff \
        --other /tmp/ref/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin

Each library runs in a fresh process of its own over ctypes (`ggml_graph_compute_with_ctx`, plain CPU buffers, 2
threads): only ggml's stable C API (init, new_tensor, get_data, the op constructors, graph compute), so the same
script drives both versions. Inputs are random, shaped as the random Qwen3-MoE's (bench/moe_model.py) layers with
32 rows; the Q4_K blocks are made once, by exo's quantizer, and fed to both. Prints one JSON line: per op, the
largest absolute difference and whether the outputs are bit-identical. Seconds.

Found with it (2026-12-01): every op bit-identical but `mul_mat_id` on Q4_K from ~12 rows on (1.1e-6): llama.cpp's
ggml has a tiled K-quant matmul (ggml-cpu/tiled, switched by GGML_CPU_TILED_MM, on by default) that the ggml of
exo-node's ggml-python wheel lacks. `GGML_CPU_TILED_MM=0` in the other side's environment makes it identical.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

F32, F16, Q4_K, I32 = 0, 1, 12, 26
THREADS = 2
NEOX, NORMAL = 2, 0
HD, HEADS, KV_HEADS, T, CELLS, H, FF, E, K = 64, 16, 4, 32, 64, 1024, 512, 8, 4


def inputs(path: Path) -> None:
    from shards.engines.ggml.lib import quantize

    rng = np.random.default_rng(0)
    experts = (rng.standard_normal((E * FF, H), dtype=np.float32) / 32).astype(np.float32)
    mask = np.zeros((T, CELLS), dtype=np.float16)
    mask[np.triu_indices(T, 1, CELLS)] = -np.inf  # row t sees cells 0..t (a causal prefill of T rows)
    mask[:, T:] = -np.inf
    np.savez(
        path,
        x=rng.standard_normal((T, HEADS, HD), dtype=np.float32),
        w=(1 + 0.1 * rng.standard_normal(HD)).astype(np.float32),
        k=(rng.standard_normal((KV_HEADS, CELLS, HD)) * 2).astype(np.float16),
        v=rng.standard_normal((KV_HEADS, CELLS, HD)).astype(np.float16),
        mask=mask,
        act=rng.standard_normal((T, H), dtype=np.float32),
        experts=quantize(experts, Q4_K, 1),  # [E*FF, blocks bytes]
        ids=rng.permutation(np.tile(np.arange(E, dtype=np.int32), T))[: T * K].reshape(T, K),
        logits=rng.standard_normal((T, E), dtype=np.float32),
        router=(rng.standard_normal((E, H), dtype=np.float32) / 8).astype(np.float32),
        gate=rng.standard_normal((T, FF), dtype=np.float32),
        up=rng.standard_normal((T, FF), dtype=np.float32),
    )


def run(lib_dir: str, inp: Path, out: Path) -> None:
    lib_dir = Path(lib_dir)
    for name in ("libggml-base.so", "libggml-cpu.so"):
        ctypes.CDLL(str(lib_dir / name), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(lib_dir / "libggml.so"), mode=ctypes.RTLD_GLOBAL)
    P, i64, c_int, c_f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float

    def fn(name, res, *args):
        f = getattr(lib, name)
        f.restype, f.argtypes = res, list(args)
        return f

    class Params(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", P), ("no_alloc", ctypes.c_bool)]

    init = fn("ggml_init", P, Params)
    new = {n: fn(f"ggml_new_tensor_{n}d", P, P, c_int, *([i64] * n)) for n in (1, 2, 3)}
    data, nbytes = fn("ggml_get_data", P, P), fn("ggml_nbytes", ctypes.c_size_t, P)
    a = np.load(inp)
    ctx = init(Params(256 << 20, None, False))

    def tensor(arr: np.ndarray, ggml_type: int, ne: tuple[int, ...]) -> int:
        t = new[len(ne)](ctx, ggml_type, *ne)
        arr = np.ascontiguousarray(arr)
        assert nbytes(t) == arr.nbytes, (nbytes(t), arr.nbytes)
        ctypes.memmove(data(t), arr.ctypes.data, arr.nbytes)
        return t

    x = tensor(a["x"], F32, (HD, HEADS, T))
    pos = tensor(np.arange(T, dtype=np.int32) + 5, I32, (T,))
    rope = fn("ggml_rope_ext", P, P, P, P, P, c_int, c_int, c_int, *([c_f] * 6))
    rms = fn("ggml_rms_norm", P, P, P, c_f)
    mul = fn("ggml_mul", P, P, P, P)
    w = tensor(a["w"], F32, (HD,))
    k, v = tensor(a["k"], F16, (HD, CELLS, KV_HEADS)), tensor(a["v"], F16, (HD, CELLS, KV_HEADS))
    mask = tensor(a["mask"], F16, (CELLS, T))
    permute = fn("ggml_permute", P, P, P, c_int, c_int, c_int, c_int)
    fa = fn("ggml_flash_attn_ext", P, P, P, P, P, P, c_f, c_f, c_f)
    act = tensor(a["act"], F32, (H, 1, T))
    experts = tensor(a["experts"], Q4_K, (H, FF, E))
    ids = tensor(a["ids"], I32, (K, T))
    mmid = fn("ggml_mul_mat_id", P, P, P, P, P)
    mm = fn("ggml_mul_mat", P, P, P, P)
    flat_experts = fn("ggml_view_2d", P, P, P, i64, i64, ctypes.c_size_t, ctypes.c_size_t)
    logits = tensor(a["logits"], F32, (E, T))
    router = tensor(a["router"], F32, (H, E))
    flat_act = tensor(a["act"], F32, (H, T))
    gate, up = tensor(a["gate"], F32, (FF, T)), tensor(a["up"], F32, (FF, T))
    silu = fn("ggml_silu", P, P, P)
    ops = {
        "rope_neox": rope(ctx, x, pos, None, HD, NEOX, 4096, 1e6, 1, 0, 1, 32, 1),
        "rope_normal": rope(ctx, x, pos, None, HD, NORMAL, 4096, 1e4, 1, 0, 1, 32, 1),
        "rms_norm_mul": mul(ctx, rms(ctx, x, 1e-6), w),
        "flash_attn": fa(ctx, permute(ctx, x, 0, 2, 1, 3), k, v, mask, 0.125, 0, 0),
        "mul_mat_q4_k": mm(ctx, flat_experts(ctx, experts, H, FF * E, int(a["experts"].shape[1]), 0), act),
        "mul_mat_id_q4_k": mmid(ctx, experts, act, ids),
        "soft_max": fn("ggml_soft_max", P, P, P)(ctx, logits),
        "silu": silu(ctx, logits),
        "mul_mat_f32_router": mm(ctx, router, flat_act),
        "silu_then_mul": mul(ctx, silu(ctx, gate), up),  # exo-node's MoE activation until this comparison
        "swiglu_split": fn("ggml_swiglu_split", P, P, P, P)(ctx, gate, up),  # llama.cpp's build_moe_ffn
    }
    graph = fn("ggml_new_graph", P, P)(ctx)
    expand = fn("ggml_build_forward_expand", None, P, P)
    for t in ops.values():
        expand(graph, t)
    status = fn("ggml_graph_compute_with_ctx", c_int, P, P, c_int)(ctx, graph, THREADS)
    assert status == 0, status
    got = {}
    for name, t in ops.items():
        n = nbytes(t)
        buf = (ctypes.c_char * n).from_address(data(t))
        got[name] = np.frombuffer(bytes(buf), dtype=np.float32)
    np.savez(out, **got)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--run":
        run(*sys.argv[2:4], Path(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, help="folder of the other libggml*.so (llama.cpp's build)")
    args = ap.parse_args()
    import ggml

    ours = Path(ggml.__file__).parent / "lib"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        inputs(work / "in.npz")
        for side, lib_dir in (("ours", ours), ("other", args.other)):
            cmd = [sys.executable, "-m", "bench.ggml_kernels_diff", "--run", str(lib_dir), str(work / "in.npz")]
            subprocess.run([*cmd, str(work / f"{side}.npz")], check=True)
        a, b = np.load(work / "ours.npz"), np.load(work / "other.npz")
        result = {
            op: {"identical": bool(np.array_equal(a[op], b[op])), "max_abs_diff": float(np.abs(a[op] - b[op]).max())}
            for op in a.files
        }
        # one graph written two ways in the same library: the unfused activation against llama.cpp's fused one
        result["silu_then_mul_vs_swiglu_split_ours"] = {
            "identical": bool(np.array_equal(a["silu_then_mul"], a["swiglu_split"])),
            "max_abs_diff": float(np.abs(a["silu_then_mul"] - a["swiglu_split"]).max()),
        }
    print(json.dumps({"ours": str(ours), "other": args.other, "ops": result}))


if __name__ == "__main__":
    main()
