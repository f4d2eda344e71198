"""The model configuration every engine reads (Llama family), in the terms of a Hugging Face config.json.

`ModelConfig.from_dir` / `from_dict` read a config.json; `formats.gguf_model.gguf_config` translates GGUF metadata
into the same type. To read whichever a path holds, use `formats.loader.load_config` (this module imports no format).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

from shards.formats.block_config import BlockConfig, BlockConfigError, gemma3_text, hf_block
from shards.formats.moe_config import MoEConfig, MoEConfigError, hf_moe
from shards.formats.refusals import missing_feature

# Architectures whose math is the Llama block with optional q/k/v biases (Qwen2) or q/k RMSNorm (Qwen3).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # mixtures of experts (shards/model/moe.py): the same attention, a routed feed-forward (formats/moe_config.py)
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "MixtralForCausalLM": "mixtral",
    # the Llama block with q/k/v and gate/up stored fused (read apart: formats/fused_layout.py)
    "Phi3ForCausalLM": "phi3",
    # GeGLU, sandwich norms, soft-capping, sliding-window layers: flags of the same block (formats/block_config.py)
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}


class ConfigError(ValueError):
    """config.json is missing, malformed or describes a model we cannot run."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # default | linear | llama3 | factors | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # kind "factors": one divisor per rotary pair, as a GGUF's rope_freqs.weight stores Llama 3.1+'s llama3 scaling
    freq_factors: tuple[float, ...] = ()
    # kind "yarn" (Qwen2.5/Qwen3 long context): the ramp between extrapolated and interpolated pairs, and the factor
    # cos/sin are multiplied by (None: 0.1 ln(factor) + 1, what transformers and llama.cpp infer)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    yarn_attention_factor: float | None = None

    def __post_init__(self) -> None:
        if (self.kind == "factors") != bool(self.freq_factors):
            raise ConfigError("rope kind 'factors' needs freq_factors, and only it takes them")
        if not all(math.isfinite(f) and f > 0 for f in self.freq_factors):
            raise ConfigError("rope frequency factors must be positive finite numbers")

    def inv_freq(self, head_dim: int) -> list[float]:
        """Per-pair rotation frequencies, float64, after any scaling (llama3 smooths between bands; `factors`
        divides each pair's frequency by its factor, as llama.cpp's rope does with rope_freqs.weight)."""
        import numpy as np

        inv = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        if self.kind == "factors":
            if len(self.freq_factors) != len(inv):
                raise ConfigError(f"{len(self.freq_factors)} rope frequency factors for {len(inv)} rotary pairs")
            return inv / np.asarray(self.freq_factors, dtype=np.float64)
        if self.kind == "yarn":
            return self._yarn(inv, head_dim)
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return np.where(medium, smoothed, scaled)
        return inv

    def _yarn(self, inv: np.ndarray, head_dim: int) -> np.ndarray:
        """Pairs rotating fewer than beta_slow times over the original context are interpolated (divided by
        factor), more than beta_fast times kept, a linear ramp between (transformers' _compute_yarn_parameters with
        truncate, llama.cpp's rope_yarn)."""
        import numpy as np

        def dim(rotations: float) -> float:
            return (
                head_dim
                * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(self.theta))
            )

        low = max(math.floor(dim(self.beta_fast)), 0)
        high = min(math.ceil(dim(self.beta_slow)), head_dim - 1)
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / max(high - low, 0.001), 0, 1)
        keep = 1 - ramp  # 1: extrapolate (the pair as trained), 0: interpolate
        return inv / self.factor * (1 - keep) + inv * keep

    @property
    def attention_factor(self) -> float:
        """What rotated queries and keys are multiplied by (YaRN's magnitude correction; 1 otherwise). Engines fold
        its square into the attention scale: q.k is all it touches."""
        if self.kind != "yarn":
            return 1.0
        if self.yarn_attention_factor is not None:
            return self.yarn_attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    moe: MoEConfig | None = None  # a mixture of experts' routing and sizes; None for a dense model
    block: BlockConfig = BlockConfig()  # how the block departs from Llama's (Gemma), as flags the one block reads

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found (is {model_dir} a Hugging Face model folder?)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: cannot read JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a JSON object")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        if raw.get("architectures") == ["Gemma3ForConditionalGeneration"]:  # its language model, without the vision
            try:
                raw = gemma3_text(raw, source)
            except BlockConfigError as e:
                raise ConfigError(str(e)) from None
        r = _Reader(raw, source)
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None) if isinstance(archs, list) else None
        if arch is None:
            raise ConfigError(
                f"{source}: unsupported architectures {archs!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
                + missing_feature(*(archs if isinstance(archs, list) else []))
            )
        model_type = SUPPORTED_ARCHITECTURES[arch]
        hidden = r.pos_int("hidden_size")
        n_heads = r.pos_int("num_attention_heads")
        n_kv = r.pos_int("num_key_value_heads", default=n_heads)
        if n_heads % n_kv:
            raise ConfigError(
                f"{source}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}"
            )
        head_dim = r.pos_int("head_dim", default=None) if raw.get("head_dim") is not None else None
        if head_dim is None:
            if hidden % n_heads:
                raise ConfigError(f"{source}: hidden_size {hidden} not divisible by num_attention_heads {n_heads}")
            head_dim = hidden // n_heads
        if head_dim % 2:
            raise ConfigError(f"{source}: head_dim {head_dim} must be even for rotary embeddings")
        eos = raw.get("eos_token_id")
        n_layers = r.pos_int("num_hidden_layers")
        max_positions = r.pos_int("max_position_embeddings", default=4096)
        if model_type == "phi3":
            _check_phi3(raw, source)
        rope, local_rope = _ropes(raw, r, source)
        try:
            moe = hf_moe(model_type, raw, n_layers, source)
            block = hf_block(model_type, raw, n_layers, local_rope=local_rope, source=source)
        except (MoEConfigError, BlockConfigError) as e:
            raise ConfigError(str(e)) from None
        return cls(
            model_type=model_type,
            architecture=arch,
            vocab_size=r.pos_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=r.pos_int("intermediate_size"),
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=r.pos_float("rms_norm_eps", default=1e-6),
            rope=rope,
            max_position_embeddings=max_positions,
            tie_word_embeddings=r.boolean("tie_word_embeddings", default=False),
            # Qwen2 always carries q/k/v biases; Llama/Mistral only when attention_bias says so.
            attention_bias=model_type in ("qwen2", "qwen2moe") or r.boolean("attention_bias", default=False),
            qk_norm=model_type in ("qwen3", "qwen3moe", "gemma3"),
            bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
            eos_token_ids=token_id_list(eos, f"{source}: eos_token_id"),
            moe=moe,
            block=block,
        )


def _check_phi3(raw: dict[str, Any], source: str) -> None:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    factor = (
        params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) if isinstance(params, dict) else 1.0
    )
    if factor != 1.0:
        raise ConfigError(
            f"{source}: partial rotary embeddings (partial_rotary_factor {factor}, Phi-4-mini style) are not supported"
        )


def _ropes(raw: dict[str, Any], r: _Reader, source: str) -> tuple[RopeConfig, RopeConfig | None]:
    """The rotary embedding of global layers, and of sliding-window layers when it differs (Gemma 3): transformers 5
    writes one rope_parameters object per layer type; older Gemma 3 configs a rope_local_base_freq."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        kinds = {k: raw | {"rope_parameters": params.get(k) or {}, "rope_theta": None} for k in params}
        if set(kinds) - {"full_attention", "sliding_attention"}:
            raise ConfigError(
                f"{source}: rope_parameters by layer type knows full_attention and sliding_attention only"
            )
        glob = _rope(kinds.get("full_attention", raw | {"rope_parameters": {}}), r, source)
        local = kinds.get("sliding_attention")
        return glob, None if local is None else _rope(local, r, source)
    local_base = raw.get("rope_local_base_freq")
    return _rope(raw, r, source), None if local_base is None else RopeConfig(theta=r.pos_float("rope_local_base_freq"))


def token_id_list(value: Any, where: str) -> tuple[int, ...]:
    """An eos_token_id field: absent, one int or a list of ints."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items):
        raise ConfigError(f"{where} must be a non-negative int or a list of them, got {value!r}")
    return tuple(items)


def _rope(raw: dict[str, Any], r: _Reader, source: str) -> RopeConfig:
    # transformers 5 writes rope_parameters (theta inside); older configs use rope_theta + rope_scaling.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: rope_parameters/rope_scaling must be an object, got {params!r}")
    theta = raw.get("rope_theta")
    theta = params.get("rope_theta", 10000.0) if theta is None else theta
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"{source}: rope_theta must be a positive number, got {theta!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise ConfigError(f"{source}: unsupported rope type {kind!r} (supported: default, linear, llama3, yarn)")
    p = _Reader(params, f"{source}: rope parameters")
    if kind == "default":
        return RopeConfig(theta=float(theta))
    if kind == "yarn":
        return _yarn(raw, params, p, float(theta), source)
    if kind == "linear":
        return RopeConfig(theta=float(theta), kind=kind, factor=p.pos_float("factor"))
    cfg = RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=p.pos_float("factor"),
        low_freq_factor=p.pos_float("low_freq_factor", default=1.0),
        high_freq_factor=p.pos_float("high_freq_factor", default=4.0),
        original_max_position_embeddings=p.pos_int("original_max_position_embeddings", default=8192),
    )
    if cfg.high_freq_factor <= cfg.low_freq_factor:
        raise ConfigError(f"{source}: llama3 rope needs high_freq_factor > low_freq_factor")
    return cfg


def _yarn(raw: dict[str, Any], params: dict[str, Any], p: _Reader, theta: float, source: str) -> RopeConfig:
    """transformers' YaRN parameters: factor, original_max_position_embeddings (default: max_position_embeddings),
    beta_fast/beta_slow, attention_factor or mscale/mscale_all_dim; `truncate: false` is refused."""
    if params.get("truncate", True) is not True:
        raise ConfigError(f"{source}: YaRN with truncate=false is not supported")
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"{source}: partial rotary embeddings (partial_rotary_factor) are not supported")
    factor = p.pos_float("factor")
    attention = p.pos_float("attention_factor", default=None) if params.get("attention_factor") is not None else None
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None and mscale and mscale_all:

        def m(scale: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

        attention = m(p.pos_float("mscale")) / m(p.pos_float("mscale_all_dim"))
    original = p.pos_int(
        "original_max_position_embeddings",
        default=_Reader(raw, source).pos_int("max_position_embeddings", default=4096),
    )
    return RopeConfig(
        theta=theta,
        kind="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=p.pos_float("beta_fast", default=32.0),
        beta_slow=p.pos_float("beta_slow", default=1.0),
        yarn_attention_factor=attention,
    )


class _Reader:
    """Typed field access with errors that name the file and the field."""

    _MISSING = object()

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw, self.source = raw, source

    def _get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key, self._MISSING)
        if value is self._MISSING or value is None:
            if default is self._MISSING:
                raise ConfigError(f"{self.source}: missing required field {key!r}")
            return default
        return value

    def pos_int(self, key: str, default: Any = _MISSING) -> int:
        value = self._get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{self.source}: {key} must be a positive integer, got {value!r}")
        return value

    def pos_float(self, key: str, default: Any = _MISSING) -> float:
        value = self._get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or not math.isfinite(value):
            raise ConfigError(f"{self.source}: {key} must be a positive number, got {value!r}")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.source}: {key} must be true or false, got {value!r}")
        return value
