"""A Llama decoder written out by hand in numpy: forward, backward, AdamW, and export to a Hugging Face folder.

The math is that of `shards.engines.numpy_engine` (RMSNorm `x * (1 / sqrt(mean(x^2) + eps)) * w`, rotary embedding in the
HF rotate_half convention, causal softmax attention scaled by 1/sqrt(head_dim), SwiGLU MLP, final RMSNorm, lm_head
tied to the embedding), with plain multi-head attention (no grouped kv heads). Parameters live in a dict keyed by
their Hugging Face tensor names, projection matrices in the HF layout [out_features, in_features], so exporting is
a cast and a `save_file`. Every function works in the dtype of the parameters: float32 to train, float64 to check
gradients against finite differences.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 256

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads


def param_shapes(s: LlamaShape) -> dict[str, tuple[int, ...]]:
    h, inter = s.hidden_size, s.intermediate_size
    shapes = {"model.embed_tokens.weight": (s.vocab_size, h)}
    for i in range(s.n_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (h, h),
            p + "self_attn.v_proj.weight": (h, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    shapes["model.norm.weight"] = (h,)
    return shapes


def init_params(s: LlamaShape, rng: np.random.Generator, dtype=np.float32, std: float = 0.02) -> dict[str, np.ndarray]:
    """Norm weights 1, matrices N(0, std); the two projections that write into the residual stream are scaled
    down by 1/sqrt(2 * n_layers) so the residual's variance does not grow with depth at initialisation."""
    params = {}
    for name, shape in param_shapes(s).items():
        if len(shape) == 1:
            params[name] = np.ones(shape, dtype=dtype)
            continue
        scale = std / math.sqrt(2 * s.n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
        params[name] = (rng.standard_normal(shape) * scale).astype(dtype)
    return params


def n_params(params: dict[str, np.ndarray]) -> int:
    return sum(a.size for a in params.values())


# -- building blocks ----------------------------------------------------------------------------------------------
def rope_tables(s: LlamaShape, seq_len: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape [T, head_dim/2], computed in float64 like the engine, then cast."""
    hd = s.head_dim
    inv_freq = 1.0 / (s.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    angles = np.arange(seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [..., T, head_dim]; pairs are (i, i + head_dim/2) (HF rotate_half)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rope_backward(dy: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """The rotation's transpose: rotating by -angle."""
    half = dy.shape[-1] // 2
    d1, d2 = dy[..., :half], dy[..., half:]
    return np.concatenate([d1 * cos + d2 * sin, d2 * cos - d1 * sin], axis=-1)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Returns (output, x normalised, 1/rms) — the last two are kept for the backward pass."""
    r = 1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps)
    xn = x * r
    return xn * w, xn, r


def rms_norm_backward(dy: np.ndarray, w: np.ndarray, xn: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dx, dw) for y = x * r * w with r = (mean(x^2) + eps)^-1/2."""
    dw = np.sum(dy * xn, axis=0)
    dxn = dy * w
    dx = r * (dxn - xn * np.mean(dxn * xn, axis=-1, keepdims=True))
    return dx, dw


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


# -- the model ----------------------------------------------------------------------------------------------------
def forward(params: dict[str, np.ndarray], s: LlamaShape, tokens: np.ndarray, keep: bool = False):
    """tokens int [B, T] -> logits [B*T, vocab] (rows in batch-major order), plus the activations the backward
    pass needs when `keep`."""
    b, t = tokens.shape
    n, nh, hd, inter = b * t, s.n_heads, s.head_dim, s.intermediate_size
    dtype = params["model.embed_tokens.weight"].dtype
    cos, sin = rope_tables(s, t, dtype)
    mask = np.triu(np.full((t, t), -np.inf, dtype=dtype), k=1)  # -inf above the diagonal: no peeking ahead
    scale = dtype.type(1.0 / math.sqrt(hd))
    x = params["model.embed_tokens.weight"][tokens.reshape(n)]
    acts = []
    for i in range(s.n_layers):
        p = f"model.layers.{i}."
        a = {"x_in": x}
        h, a["xn1"], a["r1"] = rms_norm(x, params[p + "input_layernorm.weight"], s.rms_norm_eps)
        w_qkv = np.concatenate([params[p + f"self_attn.{m}_proj.weight"] for m in "qkv"])  # [3h, h]
        qkv = (h @ w_qkv.T).reshape(b, t, 3, nh, hd).transpose(2, 0, 3, 1, 4)  # [3, B, nh, T, hd]
        q, k, v = rope(qkv[0], cos, sin), rope(qkv[1], cos, sin), qkv[2]
        scores = (q @ k.transpose(0, 1, 3, 2)) * scale + mask  # [B, nh, T, T]
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(n, nh * hd)
        x = x + ctx @ params[p + "self_attn.o_proj.weight"].T
        h2, a["xn2"], a["r2"] = rms_norm(x, params[p + "post_attention_layernorm.weight"], s.rms_norm_eps)
        w_gu = np.concatenate([params[p + "mlp.gate_proj.weight"], params[p + "mlp.up_proj.weight"]])
        gu = h2 @ w_gu.T
        gate, up = gu[:, :inter], gu[:, inter:]
        sig = _sigmoid(gate)
        act = gate * sig * up
        x = x + act @ params[p + "mlp.down_proj.weight"].T
        if keep:
            a |= dict(
                h=h,
                w_qkv=w_qkv,
                q=q,
                k=k,
                v=v,
                probs=probs,
                ctx=ctx,
                h2=h2,
                w_gu=w_gu,
                gate=gate,
                up=up,
                sig=sig,
                act=act,
            )
            acts.append(a)
    xf, xnf, rf = rms_norm(x, params["model.norm.weight"], s.rms_norm_eps)
    logits = xf @ params["model.embed_tokens.weight"].T
    if not keep:
        return logits
    return logits, dict(layers=acts, xf=xf, xnf=xnf, rf=rf, cos=cos, sin=sin, scale=scale, shape=(b, t))


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy over rows and its gradient with respect to the logits."""
    m = logits.max(axis=-1, keepdims=True)
    e = np.exp(logits - m)
    z = e.sum(axis=-1, keepdims=True)
    rows = np.arange(len(targets))
    loss = float(np.mean(np.log(z[:, 0]) + m[:, 0] - logits[rows, targets]))
    grad = e / z
    grad[rows, targets] -= 1.0
    grad /= len(targets)
    return loss, grad


def loss(params, s: LlamaShape, tokens: np.ndarray, targets: np.ndarray) -> float:
    return cross_entropy(forward(params, s, tokens), targets.reshape(-1))[0]


def loss_and_grads(params, s: LlamaShape, tokens: np.ndarray, targets: np.ndarray) -> tuple[float, dict]:
    """Mean next-token cross-entropy of `tokens` [B, T] against `targets` [B, T] and d(loss)/d(every parameter)."""
    logits, c = forward(params, s, tokens, keep=True)
    value, dlogits = cross_entropy(logits, targets.reshape(-1))
    del logits
    b, t = c["shape"]
    n, nh, hd, inter = b * t, s.n_heads, s.head_dim, s.intermediate_size
    cos, sin, scale = c["cos"], c["sin"], c["scale"]
    emb = params["model.embed_tokens.weight"]
    grads: dict[str, np.ndarray] = {}
    d_emb = dlogits.T @ c["xf"]  # tied head: the embedding also receives the lm_head gradient
    dxf = dlogits @ emb
    del dlogits
    dx, grads["model.norm.weight"] = rms_norm_backward(dxf, params["model.norm.weight"], c["xnf"], c["rf"])
    for i in reversed(range(s.n_layers)):
        p, a = f"model.layers.{i}.", c["layers"][i]
        # MLP: x += (silu(gate) * up) @ down.T
        grads[p + "mlp.down_proj.weight"] = dx.T @ a["act"]
        dact = dx @ params[p + "mlp.down_proj.weight"]
        sig, gate = a["sig"], a["gate"]
        dgu = np.empty((n, 2 * inter), dtype=dx.dtype)
        dgu[:, inter:] = dact * gate * sig
        dgu[:, :inter] = dact * a["up"] * sig * (1.0 + gate * (1.0 - sig))
        dw_gu = dgu.T @ a["h2"]
        grads[p + "mlp.gate_proj.weight"], grads[p + "mlp.up_proj.weight"] = dw_gu[:inter], dw_gu[inter:]
        dx_norm, grads[p + "post_attention_layernorm.weight"] = rms_norm_backward(
            dgu @ a["w_gu"], params[p + "post_attention_layernorm.weight"], a["xn2"], a["r2"]
        )
        dx = dx + dx_norm
        # attention: x += softmax(q k^T * scale + mask) v @ o.T
        grads[p + "self_attn.o_proj.weight"] = dx.T @ a["ctx"]
        dctx = (dx @ params[p + "self_attn.o_proj.weight"]).reshape(b, t, nh, hd).transpose(0, 2, 1, 3)
        probs = a["probs"]
        dprobs = dctx @ a["v"].transpose(0, 1, 3, 2)
        dv = probs.transpose(0, 1, 3, 2) @ dctx
        dscores = probs * (dprobs - np.sum(dprobs * probs, axis=-1, keepdims=True)) * scale
        dq = rope_backward(dscores @ a["k"], cos, sin)
        dk = rope_backward(dscores.transpose(0, 1, 3, 2) @ a["q"], cos, sin)
        dqkv = np.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4).reshape(n, 3 * nh * hd)
        dw_qkv = dqkv.T @ a["h"]
        for j, m in enumerate("qkv"):
            grads[p + f"self_attn.{m}_proj.weight"] = dw_qkv[j * nh * hd : (j + 1) * nh * hd]
        dx_norm, grads[p + "input_layernorm.weight"] = rms_norm_backward(
            dqkv @ a["w_qkv"], params[p + "input_layernorm.weight"], a["xn1"], a["r1"]
        )
        dx = dx + dx_norm
    np.add.at(d_emb, tokens.reshape(n), dx)
    grads["model.embed_tokens.weight"] = d_emb
    return value, grads


# -- optimisation -------------------------------------------------------------------------------------------------
def clip_grads(grads: dict[str, np.ndarray], max_norm: float) -> float:
    """Scale all gradients in place so their global L2 norm is at most max_norm; returns the norm before."""
    norm = math.sqrt(sum(float(np.vdot(g, g)) for g in grads.values()))
    if norm > max_norm:
        for g in grads.values():
            g *= max_norm / (norm + 1e-6)
    return norm


def lr_at(progress: float, step: int, peak: float, warmup: int, final_frac: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine decay from peak to final_frac * peak as progress goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    cos = 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return peak * (final_frac + (1.0 - final_frac) * cos)


class AdamW:
    """Adam with decoupled weight decay, applied to matrices only (not to the RMSNorm gains)."""

    def __init__(self, params: dict[str, np.ndarray], betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1):
        self.b1, self.b2 = betas
        self.eps, self.wd = eps, weight_decay
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.t = 0

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray], lr: float) -> None:
        self.t += 1
        c1, c2 = 1.0 - self.b1**self.t, 1.0 - self.b2**self.t
        for k, p in params.items():
            g, m, v = grads[k], self.m[k], self.v[k]
            m *= self.b1
            m += (1.0 - self.b1) * g
            v *= self.b2
            v += (1.0 - self.b2) * np.square(g)
            if p.ndim > 1 and self.wd:
                p *= 1.0 - lr * self.wd
            p -= (lr / c1) * m / (np.sqrt(v / c2) + self.eps)


# -- export -------------------------------------------------------------------------------------------------------
def export_hf(params, s: LlamaShape, out_dir: str | Path, bos_id: int, eos_id: int, dtype: str = "bfloat16") -> None:
    """Write config.json and model.safetensors (tied embeddings: no lm_head.weight) in `dtype`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    tensors = {k: np.ascontiguousarray(v.astype(np.float32).astype(np_dtype)) for k, v in params.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.n_layers,
        "num_attention_heads": s.n_heads,
        "num_key_value_heads": s.n_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "max_position_embeddings": s.max_position_embeddings,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
