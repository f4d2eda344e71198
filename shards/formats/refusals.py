"""Architectures people ask for that exo-node does not run yet, and the feature each lacks: a refusal names it, so
that "unsupported architecture" says what is missing rather than leaving the user to guess."""

from __future__ import annotations

MLA = "multi-head latent attention (compressed, decoupled-rope KV)"
GPT_OSS = "attention sinks, alternating sliding windows, biased clamped-SwiGLU experts and MXFP4 weights"

# Hugging Face architecture or GGUF general.architecture -> what it needs that exo-node does not implement
MISSING_FEATURES = {
    "DeepseekV2ForCausalLM": MLA,
    "DeepseekV3ForCausalLM": MLA,
    "KimiK2ForCausalLM": MLA,
    "deepseek2": MLA,
    "GptOssForCausalLM": GPT_OSS,
    "gpt-oss": GPT_OSS,
    "OlmoeForCausalLM": "OLMoE's q/k norms over all heads at once",
    "olmoe": "OLMoE's q/k norms over all heads at once",
    "Glm4MoeForCausalLM": "GLM-4.5's sigmoid expert routing with grouped top-k and partial rotary embeddings",
    "glm4moe": "GLM-4.5's sigmoid expert routing with grouped top-k and partial rotary embeddings",
}


def missing_feature(*architectures: object) -> str:
    """' (NAME needs FEATURE, not implemented)' for the first known one, else ''."""
    for arch in architectures:
        if isinstance(arch, str) and arch in MISSING_FEATURES:
            return f" ({arch} needs {MISSING_FEATURES[arch]}, which exo-node does not implement yet)"
    return ""
