"""Write a random-weight Llama checkpoint (HF layout, float32 safetensors) for benchmarks.

Default shape: hidden 2048, 8 layers, 32 heads / 4 kv heads, intermediate 3072, vocab 32000 -> 357.6M params,
the model the project's speed bar was measured on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

MID = dict(
    hidden_size=2048,
    num_hidden_layers=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    intermediate_size=3072,
    vocab_size=32000,
)


def write_random_llama(out: Path, seed: int = 0, **shape) -> Path:
    s = {**MID, **shape}
    tensors = random_llama_tensors(seed, **s)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **s,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_word_tokenizer(out, s["vocab_size"])
    return out


def random_llama_tensors(seed: int = 0, **shape) -> dict[str, np.ndarray]:
    """The checkpoint's tensors by Hugging Face name (float32)."""
    s = {**MID, **shape}
    h, n_layers, inter, vocab = s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"], s["vocab_size"]
    hd = h // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * hd
    rng = np.random.default_rng(seed)

    def mat(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * (1 / np.sqrt(shape[-1]))).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": mat(vocab, h),
        "lm_head.weight": mat(vocab, h),
        "model.norm.weight": np.ones(h, np.float32),
    }
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
            p + "self_attn.q_proj.weight": mat(h, h),
            p + "self_attn.k_proj.weight": mat(kv, h),
            p + "self_attn.v_proj.weight": mat(kv, h),
            p + "self_attn.o_proj.weight": mat(h, h),
            p + "mlp.gate_proj.weight": mat(inter, h),
            p + "mlp.up_proj.weight": mat(inter, h),
            p + "mlp.down_proj.weight": mat(h, inter),
        }
    return tensors


def write_word_tokenizer(out: Path, vocab: int) -> None:
    """A tokenizer where every id is a distinct word, so every generated token shows up as text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(out / "tokenizer.json"))
    template = "{% for m in messages %}w1 {{ m['content'] }} {% endfor %}w3"
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "w2"}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=MID["num_hidden_layers"])
    args = ap.parse_args()
    write_random_llama(args.out, num_hidden_layers=args.layers)
    print(f"wrote {args.out}")
