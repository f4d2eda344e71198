"""Mixture-of-experts operations of the ggml backend, in the graph, as llama.cpp's build_moe_ffn does them.

A layer's experts are three 3-D tensors in their stored block types ([E, ff, h] gate and up, [E, h, ff] down; a
Hugging Face checkpoint's are quantized on load like every matrix): nothing is dequantized. Per step the router's
softmax, the top-k choice (ggml_argsort_top_k) and the chosen probabilities (ggml_get_rows, renormalised with
ggml_sum_rows/ggml_div where the model says so) are graph nodes, and ggml_mul_mat_id multiplies each row by only
its chosen experts' matrices; ggml groups the rows by expert, so a batch costs one pass over each used expert.
The graph is built once per batch layout and re-run: the routing is recomputed inside it every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shards.engines.ggml.lib import F32, Tensor, g
from shards.engines.moe_backend import MoEBackend
from shards.formats.quant import QuantizedTensor


@dataclass
class GExperts:
    gate: Tensor  # ne [h, ff, E]
    up: Tensor
    down: Tensor  # ne [ff, h, E]
    nbytes: int


class GgmlMoE(MoEBackend):
    """Mixed into GgmlBackend (shards/engines/ggml/backend.py), whose `_upload`, `node`, `wrap` and `view` it uses."""

    def _stacked(self, w) -> Tensor:
        if isinstance(w, QuantizedTensor):
            ggml_type, shape, data, name = int(w.ggml_type), w.shape, w.data, w.name
        else:
            shape, name = w.shape, "experts"
            ggml_type, data = F32, np.ascontiguousarray(w, dtype=np.float32).reshape(-1, shape[-1])
        if len(shape) != 3:
            raise ValueError(f"{name}: stacked experts must be 3-D [experts, out, in], got shape {shape}")
        # in CPU_REPACK where this CPU has a mul_mat_id kernel for the type, as llama.cpp places them (its kernels
        # and rounding: bench/bench_agreement.py), unless those kernels sum a lone row otherwise than a batch's
        # (shards/engines/ggml/repack_probe.py): an expert's rows vary with the routing of every step
        return self._upload(ggml_type, shape, [data], name, matmul=True)

    def experts(self, gate, up, down) -> GExperts:
        tensors = [self._stacked(w) for w in (gate, up, down)]
        return GExperts(*tensors, nbytes=sum(int(g.ggml_nbytes(t)) for t in tensors))

    def sigmoid(self, x):
        return self.wrap(self.node(g.ggml_sigmoid, x.t), x.shape)

    def moe(self, x, router_logits, experts: GExperts, n_used: int, normalize: bool):
        n, h = x.shape
        n_experts = router_logits.shape[1]
        probs = self.node(g.ggml_soft_max, router_logits.t)  # ne [E, n]
        self.ctx.room()  # ggml_argsort_top_k makes two tensors (the argsort and its view): claim both
        chosen = self.node(g.ggml_argsort_top_k, probs, n_used)  # ne [k, n], I32, most probable first
        weights = self.node(g.ggml_get_rows, self.node(g.ggml_reshape_3d, probs, 1, n_experts, n), chosen)
        if normalize:  # ne [1, k, n] -> per row, divided by its sum
            flat = self.node(g.ggml_reshape_2d, weights, n_used, n)
            flat = self.node(g.ggml_div, flat, self.node(g.ggml_sum_rows, flat))
            weights = self.node(g.ggml_reshape_3d, flat, 1, n_used, n)
        rows = self.node(g.ggml_reshape_3d, self.contiguous(x).t, h, 1, n)
        gate = self.node(g.ggml_mul_mat_id, experts.gate, rows, chosen)  # ne [ff, k, n]
        up = self.node(g.ggml_mul_mat_id, experts.up, rows, chosen)
        act = self.node(g.ggml_mul, self.node(g.ggml_silu, gate), up)
        out = self.node(g.ggml_mul_mat_id, experts.down, act, chosen)  # ne [h, k, n]
        out = self.wrap(self.node(g.ggml_mul, out, weights), (n, n_used, h))
        total = None
        for i in range(n_used):  # sum over the chosen experts, in their order
            part = self.view(out, (n, h), (out.strides[0], 4), i * out.strides[1])
            total = part if total is None else total + part
        return self.contiguous(total) if n_used == 1 else total
