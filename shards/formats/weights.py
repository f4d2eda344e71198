"""A shard's weights, whatever format they came from: float32 (or quantized) arrays in Hugging Face layout.

These types know no file format: `formats.hf` fills them from safetensors, `formats.gguf_model` from a GGUF file,
and `formats.loader` picks which. `layer_tensor_shapes` names what a layer holds (Hugging Face's names and
shapes): the layout every loader produces and every engine reads.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from shards.formats.config import ModelConfig
from shards.formats.fused_layout import row_slice
from shards.formats.moe_layout import moe_tensor_shapes
from shards.model.shard import Shard


class WeightsError(ValueError):
    """A checkpoint file or tensor is missing, unreadable or of the wrong shape or dtype."""


@dataclass
class LayerWeights:
    """One transformer block in Hugging Face layout: projection matrices are [out_features, in_features]."""

    input_norm: np.ndarray
    q_proj: np.ndarray
    k_proj: np.ndarray
    v_proj: np.ndarray
    o_proj: np.ndarray
    post_norm: np.ndarray
    gate_proj: np.ndarray | None = None  # a dense MLP (None in a mixture-of-experts layer)
    up_proj: np.ndarray | None = None
    down_proj: np.ndarray | None = None
    q_bias: np.ndarray | None = None
    k_bias: np.ndarray | None = None
    v_bias: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    attn_out_norm: np.ndarray | None = None  # Gemma: norms of the attention's and the feed-forward's outputs
    ffn_out_norm: np.ndarray | None = None
    # a mixture-of-experts layer (shards/model/moe.py): router [E, h]; experts stacked [E, ff, h] (down: [E, h, ff])
    router: np.ndarray | None = None
    experts_gate: np.ndarray | None = None
    experts_up: np.ndarray | None = None
    experts_down: np.ndarray | None = None
    shared_gate_proj: np.ndarray | None = None  # Qwen2-MoE's shared expert, and its sigmoid gate [1, h]
    shared_up_proj: np.ndarray | None = None
    shared_down_proj: np.ndarray | None = None
    shared_expert_gate: np.ndarray | None = None

    def qkv_bias(self) -> np.ndarray | None:
        """q/k/v biases fused like their weights (see Backend.fused_weight)."""
        return None if self.q_bias is None else np.concatenate([self.q_bias, self.k_bias, self.v_bias])


@dataclass
class ShardWeights:
    shard: Shard
    layers: list[LayerWeights]
    embed_tokens: np.ndarray | None  # first shard only, [vocab, hidden]
    norm: np.ndarray | None  # last shard only
    lm_head: np.ndarray | None  # last shard only, [vocab, hidden] (the embedding when tied)

    def nbytes(self) -> int:
        arrays = [self.embed_tokens, self.norm, self.lm_head]
        arrays += [getattr(lw, f.name) for lw in self.layers for f in fields(lw)]
        return sum(a.nbytes for a in arrays if a is not None)


def layer_tensor_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """LayerWeights field -> (checkpoint tensor name, expected shape) for layer i."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.n_heads * hd, cfg.n_kv_heads * hd
    p = f"model.layers.{i}."
    spec = {
        "input_norm": (p + "input_layernorm.weight", (h,)),
        "q_proj": (p + "self_attn.q_proj.weight", (q_out, h)),
        "k_proj": (p + "self_attn.k_proj.weight", (kv_out, h)),
        "v_proj": (p + "self_attn.v_proj.weight", (kv_out, h)),
        "o_proj": (p + "self_attn.o_proj.weight", (h, q_out)),
        "post_norm": (p + "post_attention_layernorm.weight", (h,)),
    }
    if cfg.model_type == "phi3":  # q/k/v and gate/up stored fused: read as row ranges (formats.fused_layout)
        qkv, gate_up, rows = p + "self_attn.qkv_proj.weight", p + "mlp.gate_up_proj.weight", q_out + 2 * kv_out
        spec |= {
            "q_proj": (row_slice(qkv, 0, q_out, rows), (q_out, h)),
            "k_proj": (row_slice(qkv, q_out, q_out + kv_out, rows), (kv_out, h)),
            "v_proj": (row_slice(qkv, q_out + kv_out, rows, rows), (kv_out, h)),
            "gate_proj": (row_slice(gate_up, 0, inter, 2 * inter), (inter, h)),
            "up_proj": (row_slice(gate_up, inter, 2 * inter, 2 * inter), (inter, h)),
            "down_proj": (p + "mlp.down_proj.weight", (h, inter)),
        }
    elif cfg.moe is not None and cfg.moe.sparse(i):
        spec |= moe_tensor_shapes(cfg, i)
    else:
        spec |= {
            "gate_proj": (p + "mlp.gate_proj.weight", (inter, h)),
            "up_proj": (p + "mlp.up_proj.weight", (inter, h)),
            "down_proj": (p + "mlp.down_proj.weight", (h, inter)),
        }
    if cfg.block.sandwich_norms:  # Gemma's names: its post_attention_layernorm normalises the attention's output
        spec |= {
            "post_norm": (p + "pre_feedforward_layernorm.weight", (h,)),
            "attn_out_norm": (p + "post_attention_layernorm.weight", (h,)),
            "ffn_out_norm": (p + "post_feedforward_layernorm.weight", (h,)),
        }
    if cfg.attention_bias:
        spec |= {
            "q_bias": (p + "self_attn.q_proj.bias", (q_out,)),
            "k_bias": (p + "self_attn.k_proj.bias", (kv_out,)),
            "v_bias": (p + "self_attn.v_proj.bias", (kv_out,)),
        }
    if cfg.qk_norm:
        spec |= {"q_norm": (p + "self_attn.q_norm.weight", (hd,)), "k_norm": (p + "self_attn.k_norm.weight", (hd,))}
    return spec
