"""The Llama-family transformer (Llama, Mistral, Qwen2 biases, Qwen3 q/k norms, Gemma 2/3), written once for every
engine.

In the style of mlx-lm's model files: each block is a residual equation over small callables named as in Hugging
Face checkpoints. Array work goes through a `Backend`; the rows' positions (and what the backend's `rotary` made of
them), the causal masks and the row packing come ready made in a `Step` (once per forward pass, not per layer).
q/k/v and gate/up are fused into one matmul each, so a step does four weight matmuls per layer for all rows of
all requests. Gemma's departures are flags of the same block (`ModelConfig.block`, formats/block_config.py): GeGLU,
norms on the attention and feed-forward outputs, scaled embeddings, soft-capped scores and logits, and layers that
attend within a sliding window (the step's `sliding` masks and rotary, made by the runner like the causal ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shards.engines.backend import Array, Backend, KVCache
from shards.formats.config import ModelConfig
from shards.formats.weights import LayerWeights, ShardWeights
from shards.model.moe import SparseMoE


@dataclass(frozen=True)
class Step:
    """One forward pass's row layout in backend arrays: request i owns rows bounds[i]:bounds[i+1], at positions
    starts[i].. (each row's in `positions`). Positions are the step's, never an argument smuggled elsewhere: every
    backend turns them into its own rotary input once (`Backend.rotary`), and the block only passes that on."""

    bounds: Sequence[int]
    starts: Sequence[Any]  # positions already cached per request (ints, or a tracer's symbolic positions)
    positions: Array | None  # each row's position (host ints or a backend tensor; None inside a traced capture,
    #                          whose rotary tables were made from them outside it)
    rotary: Any  # Backend.rotary(positions): cos/sin tables, or the positions themselves for ggml
    masks: Sequence[Array | None]  # per request, in the backend's form (shards/engines/masks.py); None: sees all
    sliding: Sliding | None = None  # sliding-window layers' masks and rotary; None when the model has no such layer

    def rows(self, i: int) -> slice:
        return slice(int(self.bounds[i]), int(self.bounds[i + 1]))

    def attending(self, sliding: bool) -> tuple[Any, Sequence[Array | None]]:
        """(rotary, masks) for a global layer, or for a sliding-window layer."""
        if not sliding:
            return self.rotary, self.masks
        if self.sliding is None:
            raise ValueError(
                "a sliding-window layer needs the step's window masks, which this engine's runner did not make"
            )
        return self.sliding.rotary, self.sliding.masks


@dataclass(frozen=True)
class Sliding:
    """What a sliding-window layer attends with: per request, masks that also hide every cell more than the window
    behind each row (shards/engines/masks.py, `window`), and the rotary of its own base when it has one (Gemma 3's
    local layers; else the step's)."""

    masks: Sequence[Array | None]
    rotary: Any


@dataclass
class RMSNorm:
    ops: Backend
    weight: Array
    eps: float

    def __call__(self, x: Array) -> Array:
        return self.ops.rms_norm(x, self.weight, self.eps)


@dataclass
class Linear:
    ops: Backend
    weight: Array
    bias: Array | None = None

    def __call__(self, x: Array) -> Array:
        return self.ops.linear(x, self.weight, self.bias)


def norm(ops: Backend, cfg: ModelConfig, weight: np.ndarray) -> RMSNorm:
    """An RMSNorm over a checkpoint's weight, with the offset its format needs (Gemma's Hugging Face 1 + w)."""
    offset = cfg.block.norm_offset
    return RMSNorm(ops, ops.array(weight + np.float32(offset) if offset else weight), cfg.rms_norm_eps)


class Attention:
    def __init__(self, ops: Backend, cfg: ModelConfig, w: LayerWeights, sliding: bool = False):
        self.ops, self.n_heads, self.n_kv_heads, self.head_dim = ops, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.sliding, softcap = sliding, cfg.block.attn_softcap
        self.capped = {} if softcap is None else {"softcap": softcap}  # Gemma 2's soft-capped scores (attention())
        bias = w.qkv_bias()
        self.qkv_proj = Linear(
            ops, ops.fused_weight(w.q_proj, w.k_proj, w.v_proj), None if bias is None else ops.array(bias)
        )
        self.o_proj = Linear(ops, ops.weight(w.o_proj))
        self.q_norm = None if w.q_norm is None else norm(ops, cfg, w.q_norm)
        self.k_norm = None if w.k_norm is None else norm(ops, cfg, w.k_norm)
        # YaRN multiplies rotated q and k by the rope's attention factor: the same as scaling q.k by its square
        query_scale = cfg.block.query_scale or 1 / float(np.sqrt(cfg.head_dim))
        self.scale = cfg.rope.attention_factor**2 * query_scale

    def __call__(self, x: Array, step: Step, caches: Sequence[KVCache]) -> Array:
        ops, nh, nkv, hd = self.ops, self.n_heads, self.n_kv_heads, self.head_dim
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        q = qkv[:, : nh * hd].reshape(n, nh, hd)
        k = qkv[:, nh * hd : (nh + nkv) * hd].reshape(n, nkv, hd)
        v = qkv[:, (nh + nkv) * hd :].reshape(n, nkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rotary, masks = step.attending(self.sliding)
        q, k = ops.rope(q, rotary), ops.rope(k, rotary)
        outs = []
        for i, cache in enumerate(caches):  # attention is per request, against that request's own cache
            rows = step.rows(i)
            keys, values = cache.update_and_fetch(k[rows], v[rows], step.starts[i])
            outs.append(ops.attention(q[rows], keys, values, masks[i], self.scale, **self.capped))
        return self.o_proj(outs[0] if len(outs) == 1 else ops.concat(outs, axis=0))


class MLP:
    def __init__(self, ops: Backend, cfg: ModelConfig, w: LayerWeights):
        self.ops, self.intermediate = ops, cfg.intermediate_size
        self.act = "silu" if cfg.block.activation == "silu" else "gelu_tanh"  # SwiGLU, or Gemma's GeGLU
        self.gate_up_proj = Linear(ops, ops.fused_weight(w.gate_proj, w.up_proj))
        self.down_proj = Linear(ops, ops.weight(w.down_proj))

    def __call__(self, x: Array) -> Array:
        return self.down_proj(self.ops.gated(self.gate_up_proj(x), self.intermediate, self.act))


class TransformerBlock:
    """Layer `layer` of the model. `post_attention_layernorm` is Llama's: the feed-forward's input norm (Gemma's
    pre_feedforward_layernorm); Gemma's norms of the attention's and the feed-forward's outputs are `attn_out_norm`
    and `ffn_out_norm`."""

    def __init__(self, ops: Backend, cfg: ModelConfig, w: LayerWeights, layer: int = 0):
        self.input_layernorm = norm(ops, cfg, w.input_norm)
        self.self_attn = Attention(ops, cfg, w, sliding=cfg.block.sliding_layer(layer))
        self.post_attention_layernorm = norm(ops, cfg, w.post_norm)
        self.mlp = MLP(ops, cfg, w) if w.router is None else SparseMoE(ops, cfg, w)
        sandwich = cfg.block.sandwich_norms
        self.attn_out_norm = norm(ops, cfg, w.attn_out_norm) if sandwich else None
        self.ffn_out_norm = norm(ops, cfg, w.ffn_out_norm) if sandwich else None

    def __call__(self, x: Array, step: Step, caches: Sequence[KVCache]) -> Array:
        a = self.self_attn(self.input_layernorm(x), step, caches)
        h = x + (a if self.attn_out_norm is None else self.attn_out_norm(a))
        m = self.mlp(self.post_attention_layernorm(h))
        return h + (m if self.ffn_out_norm is None else self.ffn_out_norm(m))


class ShardModel:
    """A shard's layers, with the embedding on the first shard and the final norm + head on the last."""

    def __init__(self, ops: Backend, cfg: ModelConfig, w: ShardWeights):
        self.ops = ops
        self.layers: list[TransformerBlock] = []
        while w.layers:  # convert one layer at a time so peak memory stays near one shard's worth
            index = w.shard.start_layer + len(self.layers)
            self.layers.append(TransformerBlock(ops, cfg, w.layers.pop(0), layer=index))
        self.embed_tokens = None if w.embed_tokens is None else ops.table(w.embed_tokens)
        self.embed_scale = cfg.block.embed_scale  # Gemma: embeddings times sqrt(hidden)
        self.norm = None if w.norm is None else norm(ops, cfg, w.norm)
        self.lm_head = None if w.lm_head is None else Linear(ops, ops.weight(w.lm_head))
        self.final_softcap = cfg.block.final_softcap

    def __call__(
        self, x: Array, step: Step, caches: Sequence[Sequence[KVCache]], last_rows: np.ndarray | None
    ) -> Array:
        """x: token ids (first shard) or hidden rows; caches[r][l] is request r's cache of layer l. On the last shard
        returns logits of `last_rows` (all rows when None), elsewhere the hidden rows."""
        if self.embed_tokens is not None:
            x = self.ops.embedding(self.embed_tokens, x)
            if self.embed_scale != 1.0:
                x = self.ops.scale(x, self.embed_scale)
        for li, layer in enumerate(self.layers):
            layer_caches = [c[li] for c in caches]
            x = self.ops.layer_done(layer(x, step, layer_caches), layer_caches)
        if self.lm_head is None:
            return x
        if last_rows is not None:
            x = self.ops.take_rows(x, last_rows)
        logits = self.lm_head(self.norm(x))
        return logits if self.final_softcap is None else self.ops.softcap(logits, self.final_softcap)

    def parameters(self) -> list[Array]:
        """Every weight array this shard holds."""
        out: list[Array] = []

        def collect(obj: Any) -> None:
            for value in vars(obj).values():
                if isinstance(value, (RMSNorm, Linear)):
                    out.extend(a for a in (value.weight, getattr(value, "bias", None)) if a is not None)
                elif isinstance(value, (TransformerBlock, Attention, MLP)):
                    collect(value)
                elif isinstance(value, SparseMoE):
                    out.extend(value.arrays())

        for layer in self.layers:
            collect(layer)
        collect(self)
        if self.embed_tokens is not None:
            out.append(self.embed_tokens)
        return out
