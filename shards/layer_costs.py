"""What each layer of a model costs to hold, for placement (shards/partition.py) to split by bytes, not by count.

A mixture of experts' layers are dominated by their experts, and its dense layers (Qwen's mlp_only_layers) hold a
fraction of that; the first node also holds the token embedding and the last the output head, each as big as
several layers of a small model. Costs are parameter counts: within one file the weight types are close to
uniform, so they are proportional to the bytes. Dense models keep the plain layer-count split (None here): their
layers are equal, and the cluster's established splits (and the operators' expectations) stay as they were.
"""

from __future__ import annotations

from shards.formats.config import ModelConfig


def layer_costs(cfg: ModelConfig) -> tuple[int, ...] | None:
    """Parameters of each layer, the embedding counted with the first and the head with the last; None for a dense
    model (split by layer count)."""
    if cfg.moe is None:
        return None
    h = cfg.hidden_size
    attention = h * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim + cfg.n_heads * cfg.head_dim * h + 2 * h
    dense = 3 * h * cfg.intermediate_size
    sparse = cfg.moe.expert_params(h)
    costs = [attention + (sparse if cfg.moe.sparse(i) else dense) for i in range(cfg.n_layers)]
    table = cfg.vocab_size * h
    costs[0] += table
    costs[-1] += table + h  # the head (the embedding again when tied: the last node holds its own copy) and norm
    return tuple(costs)
