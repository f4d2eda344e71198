"""The mixture-of-experts part of a model's configuration: how many experts, how many each token uses, how their
router weights are normalised, which layers have them, and an optional shared expert.

Read from a Hugging Face config.json (`hf_moe`) or from GGUF metadata (formats.gguf_model). Kept apart from
formats.config so that the dense Llama-family config stays the common case, and so that one frozen value holds every
MoE fact a loader, an engine or the placement needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class MoEConfigError(ValueError):
    """The MoE fields of a config are missing or inconsistent (formats.config re-raises it as a ConfigError)."""


# model_type -> (the config field counting experts, whether the top-k weights are renormalised by default)
HF_MOE_TYPES = {
    "qwen3moe": ("num_experts", False),
    "qwen2moe": ("num_experts", False),
    "mixtral": ("num_local_experts", True),
}


@dataclass(frozen=True)
class MoEConfig:
    """Every sparse layer routes each row to `n_used` of `n_experts` experts (SwiGLU MLPs of width `expert_size`)
    by the softmax of its router's logits, the chosen probabilities renormalised to sum to 1 when `normalize`; with
    `shared_size` > 0 a shared expert's output, scaled by sigmoid(shared gate . x), is added (Qwen2-MoE).
    `dense_layers` keep a plain MLP of the model's `intermediate_size` (Qwen's mlp_only_layers / sparse step)."""

    n_experts: int
    n_used: int
    expert_size: int
    normalize: bool
    shared_size: int = 0
    dense_layers: frozenset[int] = frozenset()

    def __post_init__(self):
        for name in ("n_experts", "n_used", "expert_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise MoEConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.n_used > self.n_experts:
            raise MoEConfigError(f"{self.n_used} experts per token but only {self.n_experts} experts")
        if not isinstance(self.shared_size, int) or self.shared_size < 0:
            raise MoEConfigError(f"shared expert size must be a non-negative integer, got {self.shared_size!r}")

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def expert_params(self, hidden: int) -> int:
        """Parameters of one sparse layer's feed-forward: router, every expert, and the shared expert."""
        shared = 3 * hidden * self.shared_size + hidden if self.shared_size else 0
        return hidden * self.n_experts + 3 * self.n_experts * hidden * self.expert_size + shared


def hf_moe(model_type: str, raw: dict[str, Any], n_layers: int, source: str) -> MoEConfig | None:
    """The MoE config of a Hugging Face config.json, None for a dense model type."""
    if model_type not in HF_MOE_TYPES:
        return None
    count_key, always_normalize = HF_MOE_TYPES[model_type]
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; older files say num_experts
    n_experts = raw.get(count_key, raw.get("num_local_experts", raw.get("num_experts")))
    expert_size = (
        raw.get("moe_intermediate_size", raw.get("intermediate_size"))
        if model_type != "mixtral"
        else raw.get("intermediate_size")
    )
    step = raw.get("decoder_sparse_step", 1) or 1
    only_mlp = raw.get("mlp_only_layers") or []
    if (
        not isinstance(step, int)
        or step < 1
        or not isinstance(only_mlp, list)
        or not all(isinstance(i, int) for i in only_mlp)
    ):
        raise MoEConfigError(
            f"{source}: decoder_sparse_step must be a positive integer and mlp_only_layers a list "
            f"of layer indices, got {step!r} and {only_mlp!r}"
        )
    dense = frozenset(i for i in range(n_layers) if i in only_mlp or (i + 1) % step)
    normalize = raw.get("norm_topk_prob", always_normalize)
    if not isinstance(normalize, bool):
        raise MoEConfigError(f"{source}: norm_topk_prob must be true or false, got {normalize!r}")
    try:
        return MoEConfig(
            n_experts=n_experts,
            n_used=raw.get("num_experts_per_tok"),
            expert_size=expert_size,
            normalize=normalize or always_normalize,
            shared_size=raw.get("shared_expert_intermediate_size") or 0,
            dense_layers=dense,
        )
    except MoEConfigError as e:
        raise MoEConfigError(f"{source}: {e}") from None
