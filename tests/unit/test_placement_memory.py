"""Placement counts each layer's KV cache as well as its weights: a node holding more layers needs KV room in
proportion, and no plan gives a node more than the memory it reports (node/core/placement/layer_costs.py layer_footprints,
node/core/placement/partition.py check_memory, node/core/placement/ring.py plan_ring)."""

import shutil

import pytest

from node.core.admission import Admission, CoreLimits
from node.core.placement.layer_costs import file_bytes_per_param, kv_bytes_per_layer, layer_footprints, layer_params
from node.core.placement.partition import NodeCapacity, PartitionError, check_memory, partition
from node.core.placement.ring import plan_ring
from node.core.topology import Capabilities, NodeInfo
from shards.formats.config import ModelConfig
from shards.formats.loader import load_config
from shards.model.shard import Shard
from tests.support.models import FIXTURES

LLAMA = ModelConfig.from_dir(FIXTURES / "llama")


def footprints(cfg=LLAMA, tokens=1000, bpp=1.0):
    return layer_footprints(cfg, bytes_per_param=bpp, kv_tokens=tokens, kv_value_bytes=2)


def test_each_layer_needs_its_own_keys_and_values_for_every_position():
    kv = kv_bytes_per_layer(LLAMA, 1000, 2)
    assert kv == 1000 * 2 * LLAMA.n_kv_heads * LLAMA.head_dim * 2
    params, feet = layer_params(LLAMA), footprints()
    assert [f - p for f, p in zip(feet, params)] == [kv] * LLAMA.n_layers
    # the embedding sits with the first layer and the head with the last, KV or not
    assert feet[0] > feet[1] and feet[-1] > feet[1]


def test_the_footprint_agrees_with_what_admission_reserves():
    admission = Admission("n", "m", LLAMA, CoreLimits(kv_value_bytes=2), members=None, serves=lambda shard: True)
    assert admission.kv_bytes(Shard("m", 0, 3, LLAMA.n_layers), 1000) == 3 * kv_bytes_per_layer(LLAMA, 1000, 2)


def test_a_plan_that_fits_the_weights_but_not_their_kv_is_refused_naming_the_node():
    feet_no_kv, feet = footprints(tokens=0), footprints(tokens=100_000)
    nodes = [NodeCapacity("a", sum(feet_no_kv)), NodeCapacity("b", sum(feet_no_kv))]
    ring = partition(nodes, "m", LLAMA.n_layers)
    check_memory(ring, nodes, feet_no_kv)  # weights alone fit
    with pytest.raises(PartitionError, match=r"node a would hold layers 0-\d+: .* GiB of weights and KV cache.*"):
        check_memory(ring, nodes, feet)
    with pytest.raises(PartitionError, match="--memory-gb"):
        check_memory(ring, nodes, feet)


def test_only_the_nodes_over_their_memory_are_named_and_unknown_memory_is_not_judged():
    feet = footprints(tokens=10_000)
    half = sum(feet) // 2
    nodes = [NodeCapacity("big", 10 * sum(feet)), NodeCapacity("small", half // 10), NodeCapacity("unknown", 0)]
    ring = [("big", s) for _, s in partition([NodeCapacity("big", 1)], "m", LLAMA.n_layers)]
    check_memory(ring, nodes, feet)
    ring = partition([NodeCapacity("small", 1), NodeCapacity("unknown", 1)], "m", LLAMA.n_layers)
    with pytest.raises(PartitionError) as e:
        check_memory(ring, nodes, feet)
    assert "node small" in str(e.value) and "node unknown" not in str(e.value)


def info(node_id: str, memory: int) -> NodeInfo:
    return NodeInfo(node_id, "127.0.0.1:1000", Capabilities(memory, "numpy", "m", LLAMA.n_layers), None)


def test_plan_ring_checks_the_memory_only_when_given_footprints():
    feet = footprints(tokens=100_000)
    nodes = [info("a", sum(feet) // 4), info("b", sum(feet) // 4)]
    assert len(plan_ring(nodes, "m", LLAMA.n_layers)) == 2  # as before: no footprints, no check
    with pytest.raises(PartitionError, match="weights and KV cache"):
        plan_ring(nodes, "m", LLAMA.n_layers, footprints=feet)
    roomy = [info("a", sum(feet)), info("b", sum(feet))]
    assert len(plan_ring(roomy, "m", LLAMA.n_layers, footprints=feet)) == 2


def test_bytes_per_parameter_come_from_the_model_files_only(tmp_path):
    gguf = FIXTURES / "gguf" / "llama.gguf"
    cfg = load_config(gguf)
    expected = gguf.stat().st_size / sum(layer_params(cfg))
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(gguf, folder / gguf.name)
    shutil.copy(gguf, folder / "another-model.gguf")  # a neighbour in the same folder is not this model
    assert file_bytes_per_param(folder / gguf.name, cfg) == pytest.approx(expected)
    assert file_bytes_per_param(FIXTURES / "llama", LLAMA) > 0  # a safetensors folder


def test_footprints_refuse_nonsense():
    with pytest.raises(ValueError, match="bytes_per_param"):
        layer_footprints(LLAMA, bytes_per_param=0, kv_tokens=1, kv_value_bytes=2)


def test_plan_ring_moves_layers_to_nodes_with_room_rather_than_refusing():
    feet = footprints(tokens=100_000)
    small = sum(feet[:2])  # holds two layers, not the even third
    nodes = [info("a", 10 * sum(feet)), info("b", small), info("c", 10 * sum(feet))]
    ring = plan_ring(nodes, "m", LLAMA.n_layers, footprints=feet)
    held = {node_id: sum(feet[s.start_layer : s.end_layer]) for node_id, s in ring}
    assert held["b"] <= small and sum(s.layer_count for _, s in ring) == LLAMA.n_layers
    with pytest.raises(PartitionError, match="no split of the 6 layers fits"):
        plan_ring([info("a", small), info("b", small)], "m", LLAMA.n_layers, footprints=feet)
