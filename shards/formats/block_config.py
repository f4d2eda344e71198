"""How a model's blocks depart from the Llama block, as flags the one shared block reads (mlx-lm's style): Gemma 2
and Gemma 3 are the Llama block with a GeGLU feed-forward, norms on the attention and feed-forward outputs, scaled
embeddings, a query scale of their own, soft-capped logits, and layers that attend within a sliding window.

Read from a Hugging Face config.json (`hf_block`) or from GGUF metadata (`gguf_block`, as llama.cpp reads it). Kept
apart from formats.config so that the dense Llama config stays the common case (defaults: the Llama block), and so
that one frozen value holds every such fact an engine or a loader needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from shards.formats.gguf_names import GGUFError

if TYPE_CHECKING:  # gguf_file loads the gguf package: a GGUF model's block config is given its open file
    from shards.formats.gguf_file import GGUFFile

ACTIVATIONS = ("silu", "gelu_tanh")
# Hugging Face hidden_activation / hidden_act -> ours (Gemma's "gelu_pytorch_tanh" is the tanh approximation)
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
GEMMA_TYPES = ("gemma2", "gemma3")
# model types whose every layer attends within `sliding_window` when the config sets one, as transformers does
ALL_SLIDING_TYPES = ("mistral", "mixtral", "phi3")


class BlockConfigError(ValueError):
    """The block's flags are missing or inconsistent (formats.config re-raises it as a ConfigError)."""


@dataclass(frozen=True)
class SlidingWindow:
    """`layers` attend to their last `size` positions only (a row at position p sees cells p-size+1 .. p, as both
    transformers and llama.cpp count); `rope`, when set, is those layers' own rotary embedding (Gemma 3's local
    base), else they share the model's."""

    size: int
    layers: frozenset[int]
    rope: Any = None  # a formats.config.RopeConfig (formats.config imports this module, not the reverse)

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise BlockConfigError(f"sliding window must be a positive integer, got {self.size!r}")
        if not self.layers or not all(isinstance(i, int) and i >= 0 for i in self.layers):
            raise BlockConfigError(f"sliding-window layers must be non-negative layer indices, got {self.layers!r}")


@dataclass(frozen=True)
class BlockConfig:
    """Defaults are the Llama block. `norm_offset` is what a checkpoint's norm weights need added before use
    (Gemma's Hugging Face weights w multiply by 1 + w; its GGUF files store 1 + w already): the block adds it as it
    takes the weights (shards/model/transformer.py `norm`), so loaders hand out weights as stored."""

    activation: str = "silu"  # the gated feed-forward's gate activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    sandwich_norms: bool = False  # RMSNorm on the attention's and the feed-forward's outputs too (Gemma 2/3)
    embed_scale: float = 1.0  # the first shard multiplies looked-up embeddings by this
    query_scale: float | None = None  # what q.k is multiplied by; None: 1/sqrt(head_dim)
    attn_softcap: float | None = None  # attention scores become cap * tanh(scores / cap)
    final_softcap: float | None = None  # so do the logits
    norm_offset: float = 0.0
    sliding: SlidingWindow | None = field(default=None)

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise BlockConfigError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        for name in ("embed_scale", "query_scale", "attn_softcap", "final_softcap"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, float) and math.isfinite(value) and value > 0):
                raise BlockConfigError(f"{name} must be a positive finite float, got {value!r}")

    def sliding_layer(self, layer: int) -> bool:
        return self.sliding is not None and layer in self.sliding.layers


def embed_scale(hidden: int, dtype: Any) -> float:
    """sqrt(hidden) as transformers computes it: in the activations' dtype. A bfloat16 checkpoint (how Gemma is
    published, and what transformers runs it in) rounds it to bfloat16 (sqrt(3072) = 55.43 -> 55.5); otherwise it is
    the float32 value, which is also what llama.cpp uses for every GGUF."""
    value = np.float32(math.sqrt(hidden))
    if dtype != "bfloat16":
        return float(value)
    import ml_dtypes  # loaded for bfloat16 checkpoints only

    return float(value.astype(ml_dtypes.bfloat16))


# transformers' defaults for the fields a Gemma config.json may leave out (Gemma2Config, Gemma3TextConfig)
HF_DEFAULTS = {
    "gemma2": {
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gemma3": {"query_pre_attn_scalar": 256, "sliding_window": 4096},
}


# Gemma3TextConfig's defaults: a vision-and-text checkpoint's text_config writes only what differs from them
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}


def gemma3_text(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The config of a Gemma3ForConditionalGeneration's language model, as a Gemma3ForCausalLM config: its
    text_config over Gemma3TextConfig's defaults, with the ids and dtype the outer config names. Its vision tower is
    never loaded (formats.hf reads the language model's tensors under their text-only names)."""
    text = raw.get("text_config") or {}
    if not isinstance(text, dict):
        raise BlockConfigError(f"{source}: text_config must be an object, got {text!r}")
    outer = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "dtype", "torch_dtype") if raw.get(k) is not None}
    if "rope_parameters" in text or "rope_scaling" in text or "rope_theta" in text:  # not mixed with the defaults
        defaults = {k: v for k, v in GEMMA3_TEXT_DEFAULTS.items() if k not in ("rope_theta", "rope_local_base_freq")}
    else:
        defaults = GEMMA3_TEXT_DEFAULTS
    return defaults | outer | text | {"architectures": ["Gemma3ForCausalLM"]}


def _positive(raw: dict[str, Any], key: str, source: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or not math.isfinite(value):
        raise BlockConfigError(f"{source}: {key} must be a positive number or null, got {value!r}")
    return float(value)


def hf_block(model_type: str, raw: dict[str, Any], n_layers: int, *, local_rope: Any, source: str) -> BlockConfig:
    """The block flags of a Hugging Face config.json (the Llama block for anything but Gemma 2/3, with a sliding
    window over every layer for Mistral v0.1, Mixtral and Phi-3 when their config sets one)."""
    if model_type in ALL_SLIDING_TYPES and raw.get("sliding_window") is not None:
        return BlockConfig(sliding=SlidingWindow(raw["sliding_window"], frozenset(range(n_layers))))
    if model_type not in GEMMA_TYPES:
        return BlockConfig()
    act = raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in HF_ACTIVATIONS:
        raise BlockConfigError(
            f"{source}: hidden_activation {act!r} is not supported (supported: {sorted(HF_ACTIVATIONS)})"
        )
    if raw.get("use_bidirectional_attention"):
        raise BlockConfigError(f"{source}: bidirectional attention (an embedding model) is not supported")
    raw = HF_DEFAULTS[model_type] | raw  # (an explicit null stays null: no window, no cap)
    scalar = _positive(raw, "query_pre_attn_scalar", source)
    sliding = None
    window = raw.get("sliding_window")
    if window is not None:
        types = raw.get("layer_types")
        if types is None:  # older configs: Gemma 2 alternates from layer 0, Gemma 3 has 5 local layers : 1 global
            pattern = raw.get(
                "sliding_window_pattern", raw.get("_sliding_window_pattern", 2 if model_type == "gemma2" else 6)
            )
            if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
                raise BlockConfigError(f"{source}: sliding_window_pattern must be a positive integer, got {pattern!r}")
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
        if (
            not isinstance(types, list)
            or len(types) != n_layers
            or not set(types) <= {"sliding_attention", "full_attention"}
        ):
            raise BlockConfigError(
                f"{source}: layer_types must list 'sliding_attention' or 'full_attention' for each of the "
                f"{n_layers} layers, got {types!r}"
            )
        layers = frozenset(i for i, t in enumerate(types) if t == "sliding_attention")
        sliding = SlidingWindow(window, layers, local_rope) if layers else None
    return BlockConfig(
        activation=HF_ACTIVATIONS[act],
        sandwich_norms=True,
        embed_scale=embed_scale(raw["hidden_size"], raw.get("dtype", raw.get("torch_dtype"))),
        query_scale=None if scalar is None else scalar**-0.5,
        attn_softcap=_positive(raw, "attn_logit_softcapping", source),
        final_softcap=_positive(raw, "final_logit_softcapping", source),
        norm_offset=1.0,
        sliding=sliding,
    )


def gguf_block(
    f: GGUFFile, arch: str, *, n_layers: int, hidden: int, n_heads: int, head_dim: int, local_rope: Any
) -> BlockConfig:
    """The block flags of a GGUF file, read as llama.cpp reads them: the converter has added Gemma's +1 to the norm
    weights already; the query scale is 1/sqrt(head_dim) except for the 27B models (Gemma 2's 46 layers, Gemma 3's
    62), which use 1/sqrt(hidden / heads); the sliding-window pattern is `attention.sliding_window_pattern` when
    the file has it, else Gemma 2's every other layer from 0 and Gemma 3's 5 local : 1 global."""
    if arch == "phi3":  # every layer within the window, as transformers computes Phi-3 (llama.cpp ignores it)
        window = f.get_int("phi3.attention.sliding_window", 0)  # 0: none (Phi-4)
        return BlockConfig(sliding=SlidingWindow(window, frozenset(range(n_layers)))) if window > 0 else BlockConfig()
    if arch not in GEMMA_TYPES:
        return BlockConfig()
    big = n_layers == (46 if arch == "gemma2" else 62)
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    window = f.get_int(f"{arch}.attention.sliding_window", 4096 if arch == "gemma2" else 0)
    sliding = None
    if window > 0:
        try:
            pattern = f.get_int(pattern_key, 2 if arch == "gemma2" else 6)
        except GGUFError:
            raise GGUFError(
                f"{f.path}: {pattern_key} must be one integer (a per-layer list is not supported)"
            ) from None
        if pattern < 1:
            raise GGUFError(f"{f.path}: {pattern_key} must be positive, got {pattern}")
        layers = frozenset(i for i in range(n_layers) if i % pattern < pattern - 1)
        sliding = SlidingWindow(window, layers, local_rope) if layers else None

    def cap(key: str) -> float | None:
        value = f.get_float(f"{arch}.{key}", 0.0)
        if not (math.isfinite(value) and value >= 0):
            raise GGUFError(f"{f.path}: {arch}.{key} must be a non-negative number, got {value}")
        return value or None

    try:
        return BlockConfig(
            activation="gelu_tanh",
            sandwich_norms=True,
            embed_scale=embed_scale(hidden, "float32"),  # llama.cpp: sqrtf
            query_scale=(hidden / n_heads if big else head_dim) ** -0.5,
            attn_softcap=cap("attn_logit_softcapping") if arch == "gemma2" else None,
            final_softcap=cap("final_logit_softcapping"),
            sliding=sliding,
        )
    except BlockConfigError as e:
        raise GGUFError(f"{f.path}: {e}") from None
