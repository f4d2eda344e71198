"""GGUF as a model source: the model config from metadata, and a shard's tensors from the memory-mapped file.

GGUF names map one to one onto the Hugging Face names the engines use (`blk.3.attn_q.weight` ->
`model.layers.3.self_attn.q_proj.weight`); GGUF shapes are stored innermost-first and are reversed here, so every
tensor comes out in Hugging Face layout ([out_features, in_features]). For the `llama` architecture, llama.cpp's
converter permuted the Q and K rows for its rope kernel; `load_shard_tensors` undoes that, as transformers' own GGUF
loading does, so the engines see exactly the Hugging Face weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from shards.formats.block_config import gguf_block
from shards.formats.config import ModelConfig, RopeConfig
from shards.formats.fused_layout import parse_row_slice, row_slice
from shards.formats.gguf_file import GGUFError, GGUFFile, TensorInfo, open_gguf
from shards.formats.gguf_moe import LAYER_NAMES as MOE_LAYER_NAMES
from shards.formats.gguf_moe import LLAMA_WITH_EXPERTS, MOE_ARCHITECTURES, gguf_moe
from shards.formats.quant import SUPPORTED_TYPES, Q, QuantizedTensor, unpermute_order
from shards.formats.refusals import missing_feature
from shards.formats.weights import LayerWeights, ShardWeights, layer_tensor_shapes
from shards.model.shard import Shard

# GGUF general.architecture -> (ModelConfig.model_type, Hugging Face architecture). Mistral files say `llama`.
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    **MOE_ARCHITECTURES,
}

# LayerWeights field -> GGUF tensor name within block i
LAYER_NAMES = {
    "input_norm": "attn_norm.weight",
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight",
    "post_norm": "ffn_norm.weight",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "attn_out_norm": "post_attention_norm.weight",
    "ffn_out_norm": "post_ffw_norm.weight",
    **MOE_LAYER_NAMES,
}
# Phi-3's fused tensors (read as row ranges, as from its Hugging Face folder): Hugging Face name -> GGUF name
FUSED = {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}
EMBED, NORM, HEAD = "token_embd.weight", "output_norm.weight", "output.weight"
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+: one float32 divisor per rotary pair


def gguf_config(path: str | Path) -> ModelConfig:
    """The model config a GGUF file's metadata describes; an unsupported model is refused here, before serving."""
    f = open_gguf(path)
    arch = f.get_str("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{f.path}: unsupported architecture {arch!r}; supported: {sorted(ARCHITECTURES)}" + missing_feature(arch)
        )
    model_type, hf_arch = ARCHITECTURES[arch]
    if "rope_factors_long.weight" in f.tensors:
        raise GGUFError(f"{f.path}: LongRoPE (rope_factors_long/short, Phi-3's 128k models) is not supported")

    def pos(key: str, default: object = None) -> int:
        value = f.get_int(f"{arch}.{key}") if default is None else f.get_int(f"{arch}.{key}", default)
        if value <= 0:
            raise GGUFError(f"{f.path}: metadata {arch}.{key} must be positive, got {value}")
        return value

    hidden, n_heads = pos("embedding_length"), pos("attention.head_count")
    n_kv = pos("attention.head_count_kv", n_heads)
    if n_heads % n_kv:
        raise GGUFError(f"{f.path}: head_count {n_heads} is not a multiple of head_count_kv {n_kv}")
    if not f.has(f"{arch}.attention.key_length") and hidden % n_heads:
        raise GGUFError(f"{f.path}: embedding_length {hidden} is not divisible by head_count {n_heads}")
    head_dim = pos("attention.key_length", hidden // n_heads)
    if pos("attention.value_length", head_dim) != head_dim or head_dim % 2:
        raise GGUFError(f"{f.path}: need an even key_length equal to value_length, got {head_dim}")
    if pos("rope.dimension_count", head_dim) != head_dim:
        raise GGUFError(
            f"{f.path}: partial rotary embeddings (rope.dimension_count "
            f"{f.get_int(f'{arch}.rope.dimension_count')} < head dim {head_dim}) are not supported"
        )
    embed = f.tensor(EMBED)
    if len(embed.shape) != 2 or embed.shape[0] != hidden:
        raise GGUFError(f"{f.path}: {EMBED} has shape {list(embed.hf_shape)}, expected [vocab, {hidden}]")
    moe = gguf_moe(f, arch, pos("block_count"))
    if moe is not None and arch == "llama":
        hf_arch = LLAMA_WITH_EXPERTS
    # llama.cpp's sliding-window layers rotate with rope.freq_base_swa (Gemma 3: 10000 when absent, unscaled)
    swa_base = f"{arch}.rope.freq_base_swa"
    local_rope = RopeConfig(theta=f.get_float(swa_base, 10000.0)) if f.has(swa_base) or arch == "gemma3" else None
    block = gguf_block(
        f, arch, n_layers=pos("block_count"), hidden=hidden, n_heads=n_heads, head_dim=head_dim, local_rope=local_rope
    )
    cfg_eos = [
        f.get_int(k)
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if f.has(k)
    ]
    cfg = ModelConfig(
        model_type=model_type,
        architecture=hf_arch,
        vocab_size=embed.shape[1],
        hidden_size=hidden,
        intermediate_size=pos("feed_forward_length"),
        n_layers=pos("block_count"),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=f.get_float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope=_rope(f, arch),
        max_position_embeddings=pos("context_length", 4096),
        tie_word_embeddings=HEAD not in f.tensors,
        attention_bias=f"blk.0.{LAYER_NAMES['q_bias']}" in f.tensors,
        qk_norm=f"blk.0.{LAYER_NAMES['q_norm']}" in f.tensors,
        bos_token_id=f.get_int("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=tuple(dict.fromkeys(cfg_eos)),
        moe=moe,
        block=block,
    )
    # Check every tensor of the whole model now (presence, type, shape; no data is read), so that a file we cannot
    # run is refused at start-up, not when some node first loads its shard in the middle of a request. (First that
    # the last block is there at all: a block count of 2^31 would otherwise list billions of names.)
    if f"blk.{cfg.n_layers - 1}.{LAYER_NAMES['input_norm']}" not in f.tensors:
        raise GGUFError(
            f"{f.path}: block_count says {cfg.n_layers} blocks, but block {cfg.n_layers - 1} has no tensors"
        )
    if cfg.rope.freq_factors and len(cfg.rope.freq_factors) != head_dim // 2:
        raise GGUFError(
            f"{f.path}: {ROPE_FREQS} has {len(cfg.rope.freq_factors)} factors, expected one per rotary "
            f"pair ({head_dim // 2})"
        )
    if not (cfg.rms_norm_eps > 0 and math.isfinite(cfg.rms_norm_eps)):
        raise GGUFError(f"{f.path}: layer_norm_rms_epsilon must be a positive number, not {cfg.rms_norm_eps}")
    for name, _, shape in _hf_shapes(cfg, Shard.whole("check", cfg.n_layers)):
        cut = parse_row_slice(name, shape)
        if (name if cut is None else cut[0]) not in f.tensors:
            raise GGUFError(_missing(f, arch, name))
        stored(f, name, shape)
    return cfg


# tensors of layouts that reuse a supported general.architecture but compute differently -> the feature they mean
_LAYOUT_FEATURES = {
    "attn_qkv.weight": "a fused Q/K/V projection (attn_qkv)",
    "ffn_up_gate.weight": "a fused gate/up projection",
    "attn_sinks.weight": "attention sinks",
    "attn_post_norm.weight": "post-attention norms",
    "ffn_post_norm.weight": "post-feed-forward norms",
}


def _missing(f: GGUFFile, arch: str, name: str) -> str:
    """Why a tensor the model needs is absent, by the feature the file's own tensors show, not only by the name."""
    block = name.split(".")[1] if name.startswith("blk.") else "0"
    found = [what for suffix, what in _LAYOUT_FEATURES.items() if f"blk.{block}.{suffix}" in f.tensors]
    if found:
        return f"{f.path}: this {arch!r} file uses {', '.join(found)}, which exo-node does not implement"
    return (
        f"{f.path}: a {arch!r} model needs tensor {name!r}, which this file lacks: its layout is a variant of "
        f"{arch!r} exo-node does not run (or the file is incomplete)"
    )


def _rope(f: GGUFFile, arch: str) -> RopeConfig:
    theta = f.get_float(f"{arch}.rope.freq_base", 10000.0)
    if not theta > 0:
        raise GGUFError(f"{f.path}: {arch}.rope.freq_base must be positive, got {theta}")
    kind = f.get_str(f"{arch}.rope.scaling.type", "none")
    if ROPE_FREQS in f.tensors:  # Llama 3.1+: the converter writes its llama3 rope scaling as per-pair factors
        if kind not in ("none", ""):
            raise GGUFError(
                f"{f.path}: both {ROPE_FREQS} and rope scaling {kind!r}; llama.cpp applies both, which "
                "no known model asks for: refusing rather than guessing"
            )
        return RopeConfig(theta=theta, kind="factors", freq_factors=rope_freq_factors(f))
    if kind in ("none", ""):
        return RopeConfig(theta=theta)
    if kind == "linear":
        factor = f.get_float(f"{arch}.rope.scaling.factor")
        if not factor > 0:
            raise GGUFError(f"{f.path}: {arch}.rope.scaling.factor must be positive, got {factor}")
        return RopeConfig(theta=theta, kind="linear", factor=factor)
    if kind == "yarn":
        return _yarn(f, arch, theta)
    raise GGUFError(f"{f.path}: unsupported rope scaling {kind!r} (supported: none, linear, yarn)")


def _yarn(f: GGUFFile, arch: str, theta: float) -> RopeConfig:
    """YaRN as llama.cpp reads it: factor, original context, beta_fast/beta_slow; cos/sin scaled by
    0.1 ln(factor) + 1 times rope.scaling.attn_factor. The rarer knobs (an explicit yarn_attn_factor, a log
    multiplier, an extrapolation factor other than 1) are refused rather than guessed."""
    key = f"{arch}.rope.scaling."
    for rare in ("yarn_attn_factor", "yarn_log_multiplier"):
        if f.has(key + rare):
            raise GGUFError(f"{f.path}: YaRN with {key + rare} is not supported")
    if f.get_float(key + "yarn_ext_factor", 1.0) != 1.0:
        raise GGUFError(f"{f.path}: YaRN with {key}yarn_ext_factor other than 1 is not supported")
    factor, original = f.get_float(key + "factor"), f.get_int(key + "original_context_length")
    beta_fast, beta_slow = f.get_float(key + "yarn_beta_fast", 32.0), f.get_float(key + "yarn_beta_slow", 1.0)
    if not (factor > 0 and original > 0 and beta_fast > 0 and beta_slow > 0):
        raise GGUFError(f"{f.path}: YaRN factor, original_context_length and betas must be positive")
    attention = (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0) * f.get_float(key + "attn_factor", 1.0)
    return RopeConfig(
        theta=theta,
        kind="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=beta_fast,
        beta_slow=beta_slow,
        yarn_attention_factor=attention,
    )


def rope_freq_factors(f: GGUFFile) -> tuple[float, ...]:
    """A file's rope_freqs.weight: float32, one positive factor per rotary pair (its length is checked against the
    head dimension by RopeConfig.inv_freq, in gguf_config)."""
    info = f.tensor(ROPE_FREQS)
    if info.ggml_type != Q.F32 or len(info.shape) != 1:
        raise GGUFError(
            f"{f.path}: {ROPE_FREQS} must be a float32 vector, got {info.ggml_type.name} {list(info.hf_shape)}"
        )
    values = tuple(float(v) for v in f.raw(info).view(np.float32).reshape(-1))
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise GGUFError(f"{f.path}: {ROPE_FREQS} holds a factor that is not a positive finite number")
    return values


def _hf_shapes(cfg: ModelConfig, shard: Shard) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF tensor name, where it goes, expected Hugging Face shape) for everything the shard needs."""
    wanted = []
    for i in range(shard.start_layer, shard.end_layer):
        for field, (hf_name, shape) in layer_tensor_shapes(cfg, i).items():
            cut = parse_row_slice(hf_name, shape)  # Phi-3's fused q/k/v and gate/up: row ranges of the GGUF's too
            name = f"blk.{i}.{LAYER_NAMES[field]}"
            if cut is not None:
                base, start, stop, rows = cut
                name = row_slice(f"blk.{i}.{FUSED[base.removeprefix(f'model.layers.{i}.')]}", start, stop, rows)
            wanted.append((name, f"{i}.{field}", shape))
    embed_shape = (cfg.vocab_size, cfg.hidden_size)
    if shard.is_first:
        wanted.append((EMBED, "embed_tokens", embed_shape))
    if shard.is_last:
        wanted.append((NORM, "norm", (cfg.hidden_size,)))
        wanted.append((EMBED if cfg.tie_word_embeddings else HEAD, "lm_head", embed_shape))
    return wanted


def load_shard_tensors(
    path: str | Path, cfg: ModelConfig, shard: Shard, dequantize: bool, unpermute: bool = True
) -> dict[str, np.ndarray | QuantizedTensor]:
    """Every tensor the shard needs, keyed `embed_tokens` / `norm` / `lm_head` / `{layer}.{LayerWeights field}`.

    `dequantize=False` gives QuantizedTensors (raw block bytes from the memory map, Q/K rows already un-permuted);
    `dequantize=True` gives float32 arrays. A tied model's last shard gets the embedding as `lm_head` (the same
    object as `embed_tokens` when both are present). Only this shard's tensors are ever touched. `unpermute=False`
    leaves a `llama` file's Q/K rows in llama.cpp's order (for an engine that applies rope the way llama.cpp does:
    see `rope_pairs_interleaved`).
    """
    f = open_gguf(path)
    if shard.n_layers != cfg.n_layers:
        raise GGUFError(f"{f.path}: shard {shard} has n_layers={shard.n_layers} but the model has {cfg.n_layers}")
    out: dict[str, np.ndarray | QuantizedTensor] = {}
    by_name: dict[str, np.ndarray | QuantizedTensor] = {}
    for name, key, shape in _hf_shapes(cfg, shard):
        if name not in by_name:
            q = stored(f, name, shape)
            if (
                unpermute
                and rope_pairs_interleaved(cfg)
                and key.split(".")[-1] in ("q_proj", "k_proj", "q_bias", "k_bias")
            ):
                heads = cfg.n_heads if key.split(".")[-1].startswith("q") else cfg.n_kv_heads
                q = q.permute_rows(unpermute_order(shape[0], heads))
            by_name[name] = q.dequantize() if dequantize else q
        out[key] = by_name[name]
    return out


def rope_pairs_interleaved(cfg: ModelConfig) -> bool:
    """Whether a GGUF file of this model stores Q/K rows permuted for rope over adjacent pairs (llama.cpp's
    converter does so for the `llama` architecture), rather than Hugging Face's rotate-half halves."""
    return cfg.model_type == "llama"


def stored(f: GGUFFile, name: str, shape: tuple[int, ...]) -> QuantizedTensor:
    """The tensor `name` as stored, checked against `shape`; a row-range name (formats.fused_layout) gives those
    rows of its tensor (raw rows: whole blocks, exact for every type)."""
    cut = parse_row_slice(name, shape)
    if cut is None:
        return quantized(f, f.tensor(name), shape)
    base, start, stop, rows = cut
    whole = quantized(f, f.tensor(base), (rows, *shape[1:]))
    return QuantizedTensor(name, whole.ggml_type, shape, whole.data[start:stop])


def quantized(f: GGUFFile, info: TensorInfo, shape: tuple[int, ...]) -> QuantizedTensor:
    if info.ggml_type not in SUPPORTED_TYPES:
        raise GGUFError(
            f"{f.path}: tensor {info.name!r} has type {info.ggml_type.name}, which exo-node does not "
            f"support (supported: {', '.join(t.name for t in SUPPORTED_TYPES)})"
        )
    if info.hf_shape != shape:
        raise GGUFError(f"{f.path}: tensor {info.name!r} has shape {list(info.hf_shape)}, expected {list(shape)}")
    return QuantizedTensor(info.name, info.ggml_type, shape, f.raw(info))  # a vector is one row


def load_gguf_shard_weights(path: str | Path, cfg: ModelConfig, shard: Shard) -> ShardWeights:
    """ShardWeights (float32, Hugging Face layout) from a GGUF file, dequantized one tensor at a time."""
    tensors = load_shard_tensors(path, cfg, shard, dequantize=True)
    layers = []
    for i in range(shard.start_layer, shard.end_layer):
        fields = layer_tensor_shapes(cfg, i)
        layers.append(LayerWeights(**{k: tensors[f"{i}.{k}"] for k in fields}))
    return ShardWeights(
        shard=shard,
        layers=layers,
        embed_tokens=tensors.get("embed_tokens"),
        norm=tensors.get("norm"),
        lm_head=tensors.get("lm_head"),
    )
