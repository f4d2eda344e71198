"""Placement by each layer's compute (node/core/placement/layer_costs.py): a token goes through a sparse layer's
active experts only, a dense layer (mlp_only_layers) through all of its MLP, and the output head sits with the last
layer; equal nodes get equal compute, not equal layer counts."""

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


def test_memory_does_not_weigh_the_split_and_a_node_that_would_not_speed_the_ring_is_left_out():
    nodes = [NodeCapacity("big", 8), NodeCapacity("mid", 4), NodeCapacity("small", 1)]
    assert counts(nodes, [1] * 13) == {"big": 5, "mid": 4, "small": 4}
    # layer 0 alone is the slowest stage whatever the split: a third node only adds a hop
    assert counts(nodes, [100, 1, 1]) == {"big": 1, "mid": 2}


def test_costs_must_match_the_layers():
    with pytest.raises(PartitionError, match="3 positive sizes"):
        partition([NodeCapacity("a", 1)], "m", 3, [1, 1])


def test_a_dense_models_layers_cost_the_same_and_the_last_carries_the_head():
    cfg = ModelConfig.from_dir(FIXTURES / "llama")
    costs = layer_costs(cfg)
    assert len(set(costs[:-1])) == 1
    assert costs[-1] - costs[0] == cfg.vocab_size * cfg.hidden_size + cfg.hidden_size


def test_a_moe_layers_cost_is_its_active_experts_and_dense_layers_cost_more():
    cfg = ModelConfig.from_dir(MOE / "qwen3moe")
    costs = layer_costs(cfg)
    h, e, used, ff = cfg.hidden_size, cfg.moe.n_experts, cfg.moe.n_used, cfg.moe.expert_size
    assert 3 * used * h * ff < costs[0] < 3 * e * h * ff  # the experts a token goes through, not all of them
    dense_first = layer_costs(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dense_layers=frozenset({0}))))
    assert dense_first[0] - costs[0] == 3 * h * cfg.intermediate_size - (h * e + 3 * used * h * ff)
