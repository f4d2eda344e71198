"""Llama-family transformer layers in numpy (Llama, Mistral, Qwen2 biases, Qwen3 q/k norms), float32.

Weights are kept as [in, out] contiguous matrices with q/k/v and gate/up fused, so one step does four matmuls
per layer for all rows of all requests: `x @ W` over the packed rows is what makes batched decode pay.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .engine import Engine, Packing, StepInput
from .shard import Shard
from .weights import LayerWeights, load_shard_weights


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(var + eps)) * weight


@dataclass
class _Layer:
    input_norm: np.ndarray
    w_qkv: np.ndarray  # [hidden, q_out + 2 * kv_out]
    b_qkv: np.ndarray | None
    w_o: np.ndarray  # [q_out, hidden]
    post_norm: np.ndarray
    w_gate_up: np.ndarray  # [hidden, 2 * intermediate]
    w_down: np.ndarray  # [intermediate, hidden]
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None

    @classmethod
    def build(cls, lw: LayerWeights) -> "_Layer":
        return cls(
            input_norm=lw.input_norm,
            w_qkv=np.ascontiguousarray(lw.qkv().T),
            b_qkv=lw.qkv_bias(),
            w_o=np.ascontiguousarray(lw.o_proj.T),
            post_norm=lw.post_norm,
            w_gate_up=np.ascontiguousarray(lw.gate_up().T),
            w_down=np.ascontiguousarray(lw.down_proj.T),
            q_norm=lw.q_norm,
            k_norm=lw.k_norm,
        )

    def arrays(self) -> list[np.ndarray]:
        return [a for a in (getattr(self, f.name) for f in fields(self)) if a is not None]


class KVCache:
    """Keys and values of one request for one layer, [kv_heads, capacity, head_dim], grown by doubling."""

    def __init__(self, n_kv: int, head_dim: int, capacity: int = 64):
        self.k = np.empty((n_kv, capacity, head_dim), dtype=np.float32)
        self.v = np.empty_like(self.k)
        self.length = 0

    def append(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add [T, kv_heads, head_dim] keys/values; return views of all cached keys/values."""
        end = self.length + len(k)
        if end > self.k.shape[1]:
            cap = max(end, 2 * self.k.shape[1])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = np.empty((old.shape[0], cap, old.shape[2]), dtype=np.float32)
                new[:, : self.length] = old[:, : self.length]
                setattr(self, name, new)
        self.k[:, self.length : end] = k.transpose(1, 0, 2)
        self.v[:, self.length : end] = v.transpose(1, 0, 2)
        self.length = end
        return self.k[:, :end], self.v[:, :end]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class NumpyEngine(Engine):
    name = "numpy"

    def __init__(self, model_dir: str | Path, shard: Shard, config: ModelConfig | None = None):
        self.config = cfg = config or ModelConfig.from_dir(model_dir)
        self.shard = shard
        w = load_shard_weights(model_dir, cfg, shard)
        self.layers: list[_Layer] = []
        while w.layers:  # convert one layer at a time so peak memory stays near one shard's worth
            self.layers.append(_Layer.build(w.layers.pop(0)))
        self.embed = w.embed_tokens
        self.norm = w.norm
        self.lm_head = None if w.lm_head is None else np.ascontiguousarray(w.lm_head.T)  # [hidden, vocab]
        self.caches: dict[str, list[KVCache]] = {}

    # -- Engine interface -------------------------------------------------------------------------------------
    def forward(self, batch: list[StepInput], all_logits: bool = False) -> list[np.ndarray]:
        if not batch:
            return []
        p = self.pack(batch)
        cfg = self.config
        x = self.embed[self.tokens(batch)] if self.shard.is_first else self.hidden(batch).astype(np.float32, copy=True)
        caches = [self.caches.setdefault(item.request_id, self._new_cache()) for item in batch]
        for li, layer in enumerate(self.layers):
            x += self._attention(layer, rms_norm(x, layer.input_norm, cfg.rms_norm_eps), p, [c[li] for c in caches])
            gu = rms_norm(x, layer.post_norm, cfg.rms_norm_eps) @ layer.w_gate_up
            gate, up = gu[:, : cfg.intermediate_size], gu[:, cfg.intermediate_size :]
            x += (gate / (1.0 + np.exp(-gate)) * up) @ layer.w_down
        if not self.shard.is_last:
            return [a.copy() for a in p.split(x, False)]
        rows = x if all_logits else x[p.bounds[1:] - 1]
        return p.split(rms_norm(rows, self.norm, cfg.rms_norm_eps) @ self.lm_head, not all_logits)

    def cache_length(self, request_id: str) -> int:
        cache = self.caches.get(request_id)
        return cache[0].length if cache else 0

    def nbytes(self) -> int:
        arrays = [a for layer in self.layers for a in layer.arrays()]
        arrays += [a for a in (self.embed, self.norm, self.lm_head) if a is not None]
        return sum(a.nbytes for a in arrays)

    # -- internals --------------------------------------------------------------------------------------------
    def _new_cache(self) -> list[KVCache]:
        return [KVCache(self.config.n_kv_heads, self.config.head_dim) for _ in self.layers]

    def _attention(self, layer: _Layer, h: np.ndarray, p: Packing, caches: list[KVCache]) -> np.ndarray:
        cfg = self.config
        nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv = h @ layer.w_qkv
        if layer.b_qkv is not None:
            qkv += layer.b_qkv
        n = len(h)
        q = qkv[:, : nh * hd].reshape(n, nh, hd)
        k = qkv[:, nh * hd : (nh + nkv) * hd].reshape(n, nkv, hd)
        v = qkv[:, (nh + nkv) * hd :].reshape(n, nkv, hd)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q, k = _rotate(q, p.cos, p.sin), _rotate(k, p.cos, p.sin)
        out = np.empty((n, nh * hd), dtype=np.float32)
        group, scale = nh // nkv, 1.0 / np.sqrt(hd)
        for i, cache in enumerate(caches):
            lo, hi = p.bounds[i], p.bounds[i + 1]
            keys, values = cache.append(k[lo:hi], v[lo:hi])  # [nkv, L, hd]
            t = hi - lo
            # query heads sharing a kv head are adjacent: [T, nkv, group, hd] -> [nkv, group*T, hd]
            qi = q[lo:hi].reshape(t, nkv, group, hd).transpose(1, 2, 0, 3).reshape(nkv, group * t, hd)
            scores = (qi @ keys.transpose(0, 2, 1)) * np.float32(scale)  # [nkv, group*T, L]
            if t > 1:
                total = keys.shape[1]
                allowed = np.arange(total)[None, :] <= (p.starts[i] + np.arange(t))[:, None]  # [T, L]
                scores = np.where(np.tile(allowed, (group, 1))[None], scores, np.float32(-np.inf))
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            scores /= scores.sum(axis=-1, keepdims=True)
            ctx = scores @ values  # [nkv, group*T, hd]
            out[lo:hi] = ctx.reshape(nkv, group, t, hd).transpose(2, 0, 1, 3).reshape(t, nh * hd)
        return out @ layer.w_o


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary embedding in the HF 'rotate_half' convention: pairs are (i, i + head_dim/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
