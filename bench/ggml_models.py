"""GGUF files of bench's random 357.6M Llama (bench/random_model.py, same seed and weights) quantized to one block
type, for comparing the ggml engine with llama.cpp on the same file.

Written the way llama.cpp's converter writes a Llama: Q/K rows permuted for its rope kernel (exo-node puts them
back), F32 norms, every matrix (embedding and output included) in the chosen type, and a SentencePiece-style
vocabulary (<unk> <s> </s>, 256 byte tokens, then one piece per remaining id) so both runtimes load it.

    uv run python -m bench.ggml_models q8_0 q4_0      # -> ~/.cache/exo-node-bench/random357m-q8_0.gguf, ...
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from bench.random_model import MID, random_llama_tensors

CACHE = Path(os.environ.get("EXO_BENCH_CACHE", Path.home() / ".cache" / "exo-node-bench"))
TYPES = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "f32": Q.F32, "q2_k": Q.Q2_K, "q3_k_m": Q.Q3_K, "iq4_xs": Q.IQ4_XS}
# Per-tensor exceptions, in outline of llama-quantize's recipes (which also vary by layer: these files are not
# byte-identical to its output, but hold the same types in the same hot matmuls): Q3_K_M keeps attn_v and ffn_down in
# Q4_K, Q2_K attn_v in Q4_K; the output head is Q6_K in all three.
OVERRIDES = {
    "q3_k_m": {"attn_v": Q.Q4_K, "ffn_down": Q.Q4_K, "output": Q.Q6_K},
    "q2_k": {"attn_v": Q.Q4_K, "output": Q.Q6_K},
    "iq4_xs": {"output": Q.Q6_K},
}
NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permutation of Q/K rows (rotate-half -> interleaved pairs, per head)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, i, rest = hf.split(".", 3)  # model.layers.{i}.{module}.weight
    return f"blk.{i}.{NAMES[rest.rsplit('.', 1)[0]]}.weight"


def llama_header(w: gguf.GGUFWriter, name: str, s: dict) -> None:
    """A random Llama's metadata of shape `s` (random_model.py's keys), with the vocabulary described above."""
    w.add_name(name)
    w.add_block_count(s["num_hidden_layers"])
    w.add_context_length(4096)
    w.add_embedding_length(s["hidden_size"])
    w.add_feed_forward_length(s["intermediate_size"])
    w.add_head_count(s["num_attention_heads"])
    w.add_head_count_kv(s["num_key_value_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s["vocab_size"])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581w{i}" for i in range(s["vocab_size"] - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}{{ bos_token }}{{ m['content'] }}{% endfor %}")


def random_gguf(kind: str, seed: int = 0) -> Path:
    path = CACHE / f"random357m-{kind}.gguf"
    if path.exists():
        return path
    from shards.engines.ggml.lib import quantize

    qtype, s = TYPES[kind], MID
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    llama_header(w, f"random 357.6M Llama ({kind})", s)
    for name, t in random_llama_tensors(seed, **s).items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = s["num_attention_heads"] if "q_proj" in name else s["num_key_value_heads"]
            t = llama_permute(t, heads)
        role = gguf_name(name).split(".")[-2]  # attn_v, ffn_down, output, token_embd, ...
        ttype = OVERRIDES.get(kind, {}).get(role, qtype)
        if t.ndim == 1 or ttype == Q.F32:
            w.add_tensor(gguf_name(name), t)
        else:
            w.add_tensor(gguf_name(name), quantize(t, int(ttype), os.cpu_count() or 1), raw_dtype=ttype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kinds", nargs="+", choices=sorted(TYPES))
    for kind in ap.parse_args().kinds:
        print(random_gguf(kind))
