"""Placement of a mixture of experts by each layer's size: experts dominate a sparse layer, a dense layer
(mlp_only_layers) holds a fraction of one, the embedding and head sit with the first and last layers; dense models
keep the layer-count split."""

import dataclasses

import pytest

from node.core.placement.layer_costs import layer_costs
from node.core.placement.partition import NodeCapacity, PartitionError, partition
from shards.formats.config import ModelConfig
from tests.support.models import FIXTURES

MOE = FIXTURES / "moe"


def counts(nodes, costs, n_layers=None):
    ring = partition(nodes, "m", n_layers or len(costs), costs)
    return {node_id: shard.end_layer - shard.start_layer for node_id, shard in ring}


def test_equal_nodes_get_equal_bytes_not_equal_layer_counts():
    # layer 0 carries the embedding: as big as three layers
    assert counts([NodeCapacity("a", 1), NodeCapacity("b", 1)], [4, 1, 1, 1, 1, 1, 1, 2]) == {"a": 3, "b": 5}


def test_bytes_follow_memory_and_every_node_keeps_a_layer():
    nodes = [NodeCapacity("big", 8), NodeCapacity("mid", 4), NodeCapacity("small", 1)]
    assert counts(nodes, [1] * 13) == {"big": 8, "mid": 4, "small": 1}
    assert counts(nodes, [100, 1, 1]) == {"big": 1, "mid": 1, "small": 1}


def test_costs_must_match_the_layers():
    with pytest.raises(PartitionError, match="3 positive sizes"):
        partition([NodeCapacity("a", 1)], "m", 3, [1, 1])


def test_a_dense_model_keeps_the_layer_count_split():
    assert layer_costs(ModelConfig.from_dir(FIXTURES / "llama")) is None


def test_a_moe_layers_cost_is_its_experts_and_dense_layers_cost_less():
    cfg = ModelConfig.from_dir(MOE / "qwen3moe")
    costs = layer_costs(cfg)
    h, e, ff = cfg.hidden_size, cfg.moe.n_experts, cfg.moe.expert_size
    assert costs[1] > 3 * e * h * ff  # the experts, plus router and attention
    assert costs[0] - costs[1] == cfg.vocab_size * h  # the embedding
    sparse_first = layer_costs(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dense_layers=frozenset({1}))))
    assert sparse_first[1] < costs[1]
