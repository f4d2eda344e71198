"""A random Qwen3-MoE GGUF in Q4_K for comparing the ggml engine with llama.cpp on the same mixture-of-experts file.

Written as llama.cpp's converter writes a `qwen3moe`: experts stacked in 3-D `blk.N.ffn_{gate,up,down}_exps`, the
router `ffn_gate_inp` and the norms (q/k norms too) in F32, every other matrix (embedding and output included) in
Q4_K, quantized by ggml's reference quantizer; a SentencePiece-style vocabulary (bench/ggml_models.py's) so both
runtimes load it. Shapes: SHAPE (383M parameters, 86M active per token with the output head: hidden 1024, 6 layers, 16/4 heads of 64,
32 experts of 512, 4 per token, vocab 32000) and SHAPE_1B (1.0B parameters, 178M active: 12 layers of 32 experts of
768, the rest the same; ~570 MB, 1-3 minutes to make on 2 cores). Made once into CACHE (/tmp/exo-node-bench by
default, or $EXO_BENCH_MOE_CACHE: never the repository) and reused.

    uv run python -m bench.moe_model [--1b]   # -> /tmp/exo-node-bench/random-qwen3moe-6x32x512-q4_k.gguf

`as_float32` stores an F16 GGUF's matrices as F32 (the MoE fixtures in F32, for bench/agreement_greedy.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

CACHE = Path(os.environ.get("EXO_BENCH_MOE_CACHE", "/tmp/exo-node-bench"))
SHAPE = dict(hidden=1024, layers=6, heads=16, kv_heads=4, head_dim=64, experts=32, used=4, expert_ff=512, vocab=32000)
SHAPE_1B = {**SHAPE, "layers": 12, "expert_ff": 768}


def random_qwen3moe(seed: int = 0, **shape) -> Path:
    s = {**SHAPE, **shape}
    path = CACHE / f"random-qwen3moe-{s['layers']}x{s['experts']}x{s['expert_ff']}-q4_k.gguf"
    if path.exists():
        return path
    from shards.engines.ggml.lib import quantize

    h, hd, vocab = s["hidden"], s["head_dim"], s["vocab"]
    rng, threads = np.random.default_rng(seed), os.cpu_count() or 1
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), "qwen3moe")
    w.add_name("random Qwen3-MoE (Q4_K)")
    w.add_block_count(s["layers"])
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(4 * h)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(s["experts"])
    w.add_expert_used_count(s["used"])
    w.add_expert_feed_forward_length(s["expert_ff"])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581w{i}" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template("{% for m in messages %}{{ bos_token }}{{ m['content'] }}{% endfor %}")

    def mat(*shape) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)

    def q4k(name: str, t: np.ndarray) -> None:
        data = quantize(t.reshape(-1, t.shape[-1]), int(Q.Q4_K), threads)
        w.add_tensor(name, data.reshape(*t.shape[:-1], data.shape[-1]), raw_dtype=Q.Q4_K)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    q4k("token_embd.weight", mat(vocab, h))
    q4k("output.weight", mat(vocab, h))
    norm("output_norm.weight", h)
    e, ff = s["experts"], s["expert_ff"]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight", h)
        norm(b + "ffn_norm.weight", h)
        norm(b + "attn_q_norm.weight", hd)
        norm(b + "attn_k_norm.weight", hd)
        q4k(b + "attn_q.weight", mat(s["heads"] * hd, h))
        q4k(b + "attn_k.weight", mat(s["kv_heads"] * hd, h))
        q4k(b + "attn_v.weight", mat(s["kv_heads"] * hd, h))
        q4k(b + "attn_output.weight", mat(h, s["heads"] * hd))
        w.add_tensor(b + "ffn_gate_inp.weight", mat(e, h) * 4)  # F32; scaled so routing is decisive
        q4k(b + "ffn_gate_exps.weight", mat(e, ff, h))
        q4k(b + "ffn_up_exps.weight", mat(e, ff, h))
        q4k(b + "ffn_down_exps.weight", mat(e, h, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)
    return path


def as_float32(src: Path) -> Path:
    """`src` with every F16 tensor stored as F32 (the same values: what llama.cpp's converter writes with --outtype
    f32 from an F16 checkpoint), every other tensor and all metadata as they are. Made once into CACHE."""
    out = CACHE / f"{src.stem}.f32.gguf"
    if out.exists():
        return out
    from gguf import GGUFValueType as V

    r = gguf.GGUFReader(str(src))
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=f.types[-1] if f.types[0] == V.ARRAY else None)
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.tensor_type == Q.F16:
            w.add_tensor(t.name, data.astype(np.float32))
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out


def parameters(**shape) -> tuple[int, int]:
    """(all, active per token) parameters of a shape."""
    s = {**SHAPE, **shape}
    h, hd = s["hidden"], s["head_dim"]
    attention = h * hd * (2 * s["heads"] + 2 * s["kv_heads"]) + s["experts"] * h
    expert = 3 * h * s["expert_ff"]
    tables = 2 * s["vocab"] * h
    return (
        s["layers"] * (attention + s["experts"] * expert) + tables,
        s["layers"] * (attention + s["used"] * expert) + tables // 2,
    )


if __name__ == "__main__":
    import sys

    print(random_qwen3moe(**(SHAPE_1B if "--1b" in sys.argv else {})))
