"""What each layer of a model costs, for placement (node/core/placement/partition.py): the compute a token spends
in it (`layer_costs`, what the split balances against each node's measured speed) and the bytes a node needs to
hold it (`layer_footprints`, what caps each node's share at its memory).

Costs are parameter counts: within one file the layers' weight types are close to uniform, so compute and bytes are
both proportional to them. A token goes through every weight of a dense layer but only its `n_used` experts of a
sparse one; the first node holds the token embedding (a row lookup: no compute, but its bytes) and the last the
output head (a matmul over the vocabulary: both). The head is the exception to uniform types: GGUF files often keep
it (or the embedding it is tied to) at Q6_K, Q8_0 or F16 beside Q4 layers. `head_weight` is what one of its
parameters costs in the layers' parameters. Where a decode step is bound by memory, every weight read once, that is
its bytes' ratio (`head_weight`, from the file); where it is bound by compute, each type's kernel sets it (a Q8_0
dot product costs less per byte than a Q4_1 one). So nodes measure it (node/runtime/calibration.py) and a ring
goes by what its nodes measured (`ring_head_weight`), the file's ratio until one has.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from shards.formats.config import ModelConfig

MAX_HEAD_WEIGHT = 64.0  # a bound for what a peer reports: no head costs that many layer parameters per parameter


def layer_costs(cfg: ModelConfig, head_weight: float = 1.0) -> tuple[int, ...]:
    """Parameters a token goes through in each layer (the active experts of a sparse layer), the output head
    counted with the last at `head_weight` layer parameters each: what a node's measured speed (billions of
    parameters per second, measured on middle layers) is a rate of."""
    if not 0 < head_weight <= MAX_HEAD_WEIGHT:
        raise ValueError(f"a head weight is a positive ratio of bytes per parameter, got {head_weight}")
    costs = list(block_costs(cfg))
    costs[-1] += round(head_params(cfg) * head_weight) + cfg.hidden_size  # the head, and the final norm
    return tuple(costs)


def block_costs(cfg: ModelConfig) -> tuple[int, ...]:
    """`layer_costs` without the head: the parameters a token goes through in each transformer block."""
    h, m = cfg.hidden_size, cfg.moe
    active = (
        0
        if m is None
        else h * m.n_experts + 3 * m.n_used * h * m.expert_size + (3 * h * m.shared_size + h if m.shared_size else 0)
    )
    return tuple(_layers(cfg, active))


def head_params(cfg: ModelConfig) -> int:
    """Parameters of the output head (a matmul over the vocabulary; tied to the embedding or not)."""
    return cfg.vocab_size * cfg.hidden_size


def ring_head_weight(measured: Iterable[float], fallback: float) -> float:
    """The head weight a ring's placement goes by: the median of what its nodes measured (0: not measured), the lower
    of the middle two, else `fallback` (the file's). Every node plans with it from the same reports, so plans agree
    whichever node makes them."""
    weights = sorted(w for w in measured if w > 0)
    return weights[(len(weights) - 1) // 2] if weights else fallback


def head_weight(path: str | Path, cfg: ModelConfig) -> float:
    """The output head's bytes per parameter over the layers' matrices' in a GGUF file (its `output.weight`, else
    the tied `token_embd.weight`), rounded to 1/16: 1.7 for SmolLM2's Q4_1 file, whose head is Q8_0. 1.0 for any
    other model (a checkpoint's engine computes every weight alike)."""
    from shards.formats.gguf_file import open_gguf
    from shards.formats.loader import open_model

    src = open_model(path)
    if src.gguf is None:
        return 1.0
    tensors = open_gguf(src.gguf).tensors
    head = tensors.get("output.weight") or tensors.get("token_embd.weight")
    blocks = [t for name, t in tensors.items() if name.startswith("blk.") and len(t.shape) >= 2]
    params = sum(math.prod(t.shape) for t in blocks)
    if head is None or not params:
        return 1.0
    ratio = head.nbytes / math.prod(head.shape) / (sum(t.nbytes for t in blocks) / params)
    return max(round(ratio * 16), 1) / 16


def _layers(cfg: ModelConfig, sparse: int) -> list[int]:
    """Each layer's attention and feed-forward parameters: dense, or `sparse` where a mixture's layer is sparse."""
    attention, dense = _attention(cfg), 3 * cfg.hidden_size * cfg.intermediate_size
    if cfg.moe is None:
        return [attention + dense] * cfg.n_layers
    return [attention + (sparse if cfg.moe.sparse(i) else dense) for i in range(cfg.n_layers)]


def _attention(cfg: ModelConfig) -> int:
    h = cfg.hidden_size
    return h * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim + cfg.n_heads * cfg.head_dim * h + 2 * h


def layer_params(cfg: ModelConfig) -> tuple[int, ...]:
    """Parameters of each layer of any model, dense or not, the embedding with the first and the head with the
    last."""
    h = cfg.hidden_size
    costs = _layers(cfg, 0 if cfg.moe is None else cfg.moe.expert_params(h))
    table = cfg.vocab_size * h
    costs[0] += table
    costs[-1] += table + h  # the head (the embedding again when tied: the last node holds its own copy) and norm
    return tuple(costs)


def kv_bytes_per_layer(cfg: ModelConfig, tokens: int, value_bytes: int) -> int:
    """Bytes of one layer's KV cache for `tokens` positions: keys and values of every KV head."""
    return 2 * cfg.n_kv_heads * cfg.head_dim * value_bytes * tokens


def layer_footprints(
    cfg: ModelConfig, *, bytes_per_param: float, kv_tokens: int, kv_value_bytes: int
) -> tuple[int, ...]:
    """Bytes each layer needs on the node that holds it: its weights (its parameters at the model's bytes per
    parameter, embedding and head with the first and last) plus its KV cache for `kv_tokens` positions. A node
    holding more layers needs KV room in proportion: every layer it holds keeps its own keys and values."""
    if bytes_per_param <= 0 or kv_tokens < 0 or kv_value_bytes <= 0:
        raise ValueError("footprints need bytes_per_param > 0, kv_tokens >= 0, kv_value_bytes > 0")
    kv = kv_bytes_per_layer(cfg, kv_tokens, kv_value_bytes)
    return tuple(round(p * bytes_per_param) + kv for p in layer_params(cfg))


def file_bytes_per_param(path: str | Path, cfg: ModelConfig) -> float | None:
    """The model's weight files' bytes per parameter (GGUF or safetensors as stored; a node quantizing on load
    holds other sizes), or None when there are none on disk yet (a node still fetching them)."""
    from shards.formats.loader import SPLIT_NAME, open_model

    src = open_model(path)
    if src.gguf is not None:  # the file, with its split siblings
        m = SPLIT_NAME.match(src.gguf.name)
        files = sorted(src.root.glob(f"{m.group('prefix')}-*-of-*.gguf")) if m else [src.gguf]
    else:
        files = sorted(src.root.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in files if p.is_file())
    return total / sum(layer_params(cfg)) if total else None


def engine_head_weight(path: str | Path | None, engine: str, quantize: str | None) -> float:
    """`head_weight` as `engine` holds the model: the file's types only on the ggml engine without --quantize or with
    `--quantize none` (any other requantizes every matrix, the head too, to one type; the other engines compute
    every weight alike); 1.0 for a model not on disk yet."""
    if path is None or engine != "ggml" or quantize not in (None, "none"):  # "none": --quantize none, as given
        return 1.0
    from shards.formats.loader import load_config

    return head_weight(path, load_config(path))
