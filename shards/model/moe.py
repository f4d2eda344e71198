"""The mixture-of-experts feed-forward of the shared transformer block (Qwen3-MoE, Qwen2-MoE, Mixtral).

In mlx-lm's style: a module named as in Hugging Face checkpoints (`gate` is the router, `experts`, Qwen2-MoE's
`shared_expert` and `shared_expert_gate`), a residual equation over small callables. The routing and the experts'
matmuls are one backend operation (`MoEBackend.moe`): the ggml engine does them in the graph with
ggml_mul_mat_id on the experts' quantized blocks, as llama.cpp does; the numpy engine routes on the host and
multiplies each used expert once per step. A node that holds a layer holds all its experts.
"""

from __future__ import annotations

from typing import Any

from shards.engines.backend import Array, Backend
from shards.engines.moe_backend import MoEBackend
from shards.formats.config import ModelConfig
from shards.formats.weights import LayerWeights

MOE_ENGINES = ("ggml", "numpy", "mlx")  # tinygrad: its TinyJit captures would freeze one step's routing


class UnsupportedMoE(ValueError):
    """The engine has no mixture-of-experts operations."""


def check_engine(engine: str, cfg: ModelConfig) -> None:
    """At start-up: refuse a mixture of experts on an engine that cannot run it (rather than at the first load)."""
    if cfg.moe is not None and engine not in MOE_ENGINES:
        raise UnsupportedMoE(
            f"{cfg.architecture} is a mixture of experts, which the {engine} engine does not run; "
            f"use --engine {', '.join(MOE_ENGINES)}"
        )


class SparseMoE:
    def __init__(self, ops: Backend, cfg: ModelConfig, w: LayerWeights):
        if not isinstance(ops, MoEBackend):
            raise UnsupportedMoE(
                f"{cfg.architecture} is a mixture of experts, which the {ops.name} engine does "
                f"not run; use --engine {', '.join(MOE_ENGINES)}"
            )
        self.ops, self.moe = ops, cfg.moe
        self.gate = ops.weight(w.router)
        self.experts = ops.experts(w.experts_gate, w.experts_up, w.experts_down)
        self.shared_expert = None
        if w.shared_gate_proj is not None:
            self.shared_size = w.shared_gate_proj.shape[0]
            self.shared_expert = (
                ops.fused_weight(w.shared_gate_proj, w.shared_up_proj),
                ops.weight(w.shared_down_proj),
            )
            self.shared_expert_gate = ops.weight(w.shared_expert_gate)

    def __call__(self, x: Array) -> Array:
        ops = self.ops
        out = ops.moe(x, ops.linear(x, self.gate), self.experts, self.moe.n_used, self.moe.normalize)
        if self.shared_expert is not None:
            gate_up, down = self.shared_expert
            h = ops.linear(x, gate_up)
            shared = ops.linear(ops.gated(h, self.shared_size, "silu"), down)
            out = out + shared * ops.sigmoid(ops.linear(x, self.shared_expert_gate))
        return out

    def arrays(self) -> list[Any]:
        """Every weight this feed-forward holds (for ShardModel.parameters)."""
        shared = [*self.shared_expert, self.shared_expert_gate] if self.shared_expert is not None else []
        experts = [w for pair in self.experts for w in pair] if isinstance(self.experts, list) else [self.experts]
        return [self.gate, *experts, *shared]
