"""The ggml backend's operations for Gemma's flags of the shared block (formats/block_config.py): the GeGLU gate,
soft-capping, and the rotary of sliding-window layers with their own base (Gemma 3's local layers).

Soft-capped attention scores are not here: GgmlBackend.gemm_attention caps its scores itself, cap * tanh(scale *
q.k / cap) before adding the mask, as transformers and llama.cpp do (and ggml_flash_attn_ext's `logit_softcap` under
ATTENTION "flash"). The sliding window itself is a mask, an input like the causal one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shards.engines.ggml.lib import F32, Tensor, g
from shards.formats.config import ModelConfig


@dataclass(frozen=True)
class SlidingRotary:
    """A sliding-window layer's rotary on the ggml backend: the rows' positions (I32 [rows]), rotated with this base
    and these per-pair frequency divisors (None: none) instead of the model's."""

    positions: Any  # GArray
    theta: float
    factors: Tensor | None


class GemmaOps:
    """Mixed into GgmlBackend, whose `node`, `wrap` and `_upload` these use."""

    def sliding_rope(self, cfg: ModelConfig) -> tuple[float, Tensor | None] | None:
        """(base, divisors tensor or None) of the sliding-window layers' own rotary; None when they share the
        model's. Called once, while the backend still uploads weights."""
        window = cfg.block.sliding
        if window is None or window.rope is None:
            return None
        rope, hd = window.rope, cfg.head_dim
        default = 1.0 / (rope.theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        factors = (default / np.asarray(rope.inv_freq(hd))).astype(np.float32)
        return rope.theta, None if np.all(factors == 1.0) else self._upload(F32, factors.shape, [factors], "rope")

    def sliding_rotary(self, positions) -> Any:
        """What a sliding-window layer's `rope` takes: the positions themselves when those layers share the model's
        rotary, else a SlidingRotary naming their own."""
        own = self.local_rope
        return positions if own is None else SlidingRotary(positions, own[0], own[1])

    def gelu_tanh(self, x):
        """ggml_gelu: the tanh approximation (through ggml's F16 lookup table on CPU, as in llama.cpp)."""
        return self.wrap(self.node(g.ggml_gelu, x.t), x.shape)

    def scale(self, x, factor: float):
        return self.wrap(self.node(g.ggml_scale, x.t, factor), x.shape)

    def softcap(self, x, cap: float):
        t = self.node(g.ggml_scale, x.t, 1.0 / cap)
        t = self.node(g.ggml_tanh, t)
        return self.wrap(self.node(g.ggml_scale, t, cap), x.shape)
