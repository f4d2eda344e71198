"""Llama-family layers in MLX (the engine for Apple Silicon; on Linux it runs on the CPU via mlx[cpu]).

Same math and weight fusion as the numpy engine: packed rows of all requests through one matmul per projection,
attention per request against its own KV cache. Activations leave as numpy float32, whatever the device.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

try:
    import mlx.core as mx
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("the mlx engine needs MLX: pip install 'exo-node[mlx]'") from e

from .config import ModelConfig
from .engine import Engine, Packing, StepInput
from .shard import Shard
from .weights import LayerWeights, load_shard_weights


def _rms_norm(x: "mx.array", weight: "mx.array", eps: float) -> "mx.array":
    return x * mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + eps) * weight


def _rotate(x: "mx.array", cos: "mx.array", sin: "mx.array") -> "mx.array":
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class _Layer:
    def __init__(self, lw: LayerWeights):
        t = lambda a: None if a is None else mx.array(a)  # noqa: E731
        self.input_norm, self.post_norm = t(lw.input_norm), t(lw.post_norm)
        self.w_qkv = mx.array(lw.qkv().T)  # [in, out]
        self.b_qkv = t(lw.qkv_bias())
        self.w_o = mx.array(lw.o_proj.T)
        self.w_gate_up = mx.array(lw.gate_up().T)
        self.w_down = mx.array(lw.down_proj.T)
        self.q_norm, self.k_norm = t(lw.q_norm), t(lw.k_norm)

    def arrays(self) -> list:
        return [a for a in vars(self).values() if a is not None]


class MlxEngine(Engine):
    name = "mlx"

    def __init__(self, model_dir: str | Path, shard: Shard, config: ModelConfig | None = None):
        self.config = cfg = config or ModelConfig.from_dir(model_dir)
        self.shard = shard
        w = load_shard_weights(model_dir, cfg, shard)
        self.layers = []
        while w.layers:
            self.layers.append(_Layer(w.layers.pop(0)))
        self.embed = None if w.embed_tokens is None else mx.array(w.embed_tokens)
        self.norm = None if w.norm is None else mx.array(w.norm)
        self.lm_head = None if w.lm_head is None else mx.array(w.lm_head.T)
        mx.eval([a for layer in self.layers for a in layer.arrays()] +
                [a for a in (self.embed, self.norm, self.lm_head) if a is not None])
        self.caches: dict[str, list[list]] = {}  # request -> per layer [keys, values] as [kv_heads, L, head_dim]

    def forward(self, batch: list[StepInput], all_logits: bool = False) -> list[np.ndarray]:
        if not batch:
            return []
        p = self.pack(batch)
        cfg = self.config
        x = self.embed[mx.array(self.tokens(batch).astype(np.int32))] if self.shard.is_first else mx.array(self.hidden(batch))
        cos, sin = mx.array(p.cos), mx.array(p.sin)
        caches = [self.caches.setdefault(item.request_id, [[None, None] for _ in self.layers]) for item in batch]
        for li, layer in enumerate(self.layers):
            x = x + self._attention(layer, _rms_norm(x, layer.input_norm, cfg.rms_norm_eps), cos, sin, p,
                                    [c[li] for c in caches])
            gu = _rms_norm(x, layer.post_norm, cfg.rms_norm_eps) @ layer.w_gate_up
            gate, up = gu[:, : cfg.intermediate_size], gu[:, cfg.intermediate_size:]
            x = x + (gate * mx.sigmoid(gate) * up) @ layer.w_down
            mx.eval(x, [c[li] for c in caches])  # keep the graph one layer deep
        if not self.shard.is_last:
            return p.split(np.array(x), False)
        rows = x if all_logits else x[mx.array(p.bounds[1:] - 1)]
        return p.split(np.array(_rms_norm(rows, self.norm, cfg.rms_norm_eps) @ self.lm_head), not all_logits)

    def _attention(self, layer: _Layer, h, cos, sin, p: Packing, caches: list[list]):
        cfg = self.config
        nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv = h @ layer.w_qkv
        if layer.b_qkv is not None:
            qkv = qkv + layer.b_qkv
        n = h.shape[0]
        q = qkv[:, : nh * hd].reshape(n, nh, hd)
        k = qkv[:, nh * hd : (nh + nkv) * hd].reshape(n, nkv, hd)
        v = qkv[:, (nh + nkv) * hd :].reshape(n, nkv, hd)
        if layer.q_norm is not None:
            q, k = _rms_norm(q, layer.q_norm, cfg.rms_norm_eps), _rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group, outs = nh // nkv, []
        for i, cache in enumerate(caches):
            lo, hi = int(p.bounds[i]), int(p.bounds[i + 1])
            t = hi - lo
            kn, vn = k[lo:hi].transpose(1, 0, 2), v[lo:hi].transpose(1, 0, 2)  # [nkv, T, hd]
            cache[0] = kn if cache[0] is None else mx.concatenate([cache[0], kn], axis=1)
            cache[1] = vn if cache[1] is None else mx.concatenate([cache[1], vn], axis=1)
            qi = q[lo:hi].reshape(t, nkv, group, hd).transpose(1, 2, 0, 3).reshape(nkv, group * t, hd)
            scores = (qi @ cache[0].transpose(0, 2, 1)) * (1.0 / np.sqrt(hd))
            if t > 1:
                total = cache[0].shape[1]
                allowed = np.arange(total)[None, :] <= (p.starts[i] + np.arange(t))[:, None]
                scores = mx.where(mx.array(np.tile(allowed, (group, 1))[None]), scores, -np.inf)
            ctx = mx.softmax(scores, axis=-1) @ cache[1]
            outs.append(ctx.reshape(nkv, group, t, hd).transpose(2, 0, 1, 3).reshape(t, nh * hd))
        return mx.concatenate(outs, axis=0) @ layer.w_o

    def cache_length(self, request_id: str) -> int:
        cache = self.caches.get(request_id)
        return 0 if not cache or cache[0][0] is None else cache[0][0].shape[1]

    def nbytes(self) -> int:
        arrays = [a for layer in self.layers for a in layer.arrays()]
        arrays += [a for a in (self.embed, self.norm, self.lm_head) if a is not None]
        return sum(a.nbytes for a in arrays)
