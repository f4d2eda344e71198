"""A GGUF file's mixture-of-experts metadata and tensor names (llama.cpp's: `{arch}.expert_count`,
`blk.N.ffn_gate_exps`, ...), read into the same MoEConfig and LayerWeights fields as a Hugging Face folder.

Which layers are sparse is read off the tensors (a block with `ffn_gate_inp` routes); whether the chosen experts'
weights are renormalised is fixed per architecture, as llama.cpp fixes it (qwen3moe and Mixtral's `llama`: yes;
qwen2moe: no).
"""

from __future__ import annotations

from shards.formats.gguf_file import GGUFError, GGUFFile
from shards.formats.moe_config import MoEConfig, MoEConfigError

# general.architecture -> whether the top-k router weights are renormalised (llama.cpp's build_moe_ffn norm_w)
NORMALIZED = {"qwen3moe": True, "qwen2moe": False, "llama": True}
# GGUF architecture -> (ModelConfig.model_type, Hugging Face architecture) for MoE-only architectures, and the
# Hugging Face architecture a `llama` file with experts is (Mixtral: llama.cpp converts it to `llama`).
MOE_ARCHITECTURES = {"qwen3moe": ("qwen3moe", "Qwen3MoeForCausalLM"), "qwen2moe": ("qwen2moe", "Qwen2MoeForCausalLM")}
LLAMA_WITH_EXPERTS = "MixtralForCausalLM"

LAYER_NAMES = {
    "router": "ffn_gate_inp.weight",
    "experts_gate": "ffn_gate_exps.weight",
    "experts_up": "ffn_up_exps.weight",
    "experts_down": "ffn_down_exps.weight",
    "shared_gate_proj": "ffn_gate_shexp.weight",
    "shared_up_proj": "ffn_up_shexp.weight",
    "shared_down_proj": "ffn_down_shexp.weight",
    "shared_expert_gate": "ffn_gate_inp_shexp.weight",
}


def gguf_moe(f: GGUFFile, arch: str, n_layers: int) -> MoEConfig | None:
    """The file's MoE config; None when it has no experts (no `{arch}.expert_count`, or 0)."""
    count = f.get_int(f"{arch}.expert_count", 0) if f.has(f"{arch}.expert_count") else 0
    if not count:
        if arch in MOE_ARCHITECTURES:
            raise GGUFError(f"{f.path}: a {arch} file without {arch}.expert_count")
        return None
    if arch not in NORMALIZED:
        raise GGUFError(
            f"{f.path}: mixture-of-experts {arch!r} files are not supported (supported: "
            f"{', '.join(sorted(NORMALIZED))}, llama meaning Mixtral)"
        )
    size_key = (
        f"{arch}.expert_feed_forward_length"
        if f.has(f"{arch}.expert_feed_forward_length")
        else f"{arch}.feed_forward_length"
    )
    shared = f"{arch}.expert_shared_feed_forward_length"
    n_layers = min(n_layers, 1 << 16)  # block_count is checked against the tensors later
    try:
        return MoEConfig(
            n_experts=count,
            n_used=f.get_int(f"{arch}.expert_used_count"),
            expert_size=f.get_int(size_key),
            normalize=NORMALIZED[arch],
            shared_size=f.get_int(shared) if f.has(shared) else 0,
            dense_layers=frozenset(i for i in range(n_layers) if f"blk.{i}.{LAYER_NAMES['router']}" not in f.tensors),
        )
    except MoEConfigError as e:
        raise GGUFError(f"{f.path}: {e}") from None
