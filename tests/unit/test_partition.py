"""How a model's layers are split across the nodes of the ring."""

import itertools
import random

import pytest

from node.core.placement.partition import NodeCapacity, PartitionError, partition
from shards.model.shard import Shard

GB = 1 << 30


def node(node_id: str, gb: float = 8, pinned: tuple[int, int] | None = None) -> NodeCapacity:
    return NodeCapacity(node_id, int(gb * GB), pinned)


def layout(ring: list[tuple[str, Shard]]) -> list[tuple[str, int, int]]:
    return [(node_id, s.start_layer, s.end_layer) for node_id, s in ring]


def counts(ring: list[tuple[str, Shard]]) -> dict[str, int]:
    return {node_id: s.layer_count for node_id, s in ring}


# --- automatic: equal speeds (node/core/placement/balance.py; tests/unit/test_placement_speed.py for speeds) ---


def test_equal_memory_splits_evenly():
    ring = partition([node("a"), node("b"), node("c")], "m", 6)
    assert layout(ring) == [("a", 0, 2), ("b", 2, 4), ("c", 4, 6)]
    assert all(s.model_id == "m" and s.n_layers == 6 for _, s in ring)


def test_leftover_layers_go_to_the_first_nodes_in_order():
    ring = partition([node("c"), node("a"), node("b")], "m", 8)
    assert layout(ring) == [("a", 0, 3), ("b", 3, 6), ("c", 6, 8)]


def test_memory_only_caps_the_split_so_bigger_nodes_get_no_more_layers():
    ring = partition([node("small1", 8), node("big", 16), node("small2", 8)], "m", 8)
    assert layout(ring) == [("big", 0, 3), ("small1", 3, 6), ("small2", 6, 8)]


def test_tiny_or_unknown_memory_is_not_judged_without_footprints():
    nodes = [node("big", 100), NodeCapacity("tiny1", 1), NodeCapacity("tiny2", 1), NodeCapacity("zero", 0)]
    assert counts(partition(nodes, "m", 10)) == {"big": 3, "tiny1": 3, "tiny2": 2, "zero": 2}


def test_more_nodes_than_layers_uses_only_the_first_n_layers_nodes_by_id():
    nodes = [node("e", 1), node("d", 2), node("c", 3), node("b", 3), node("a", 4)]
    assert layout(partition(nodes, "m", 3)) == [("a", 0, 1), ("b", 1, 2), ("c", 2, 3)]


def test_single_node_holds_the_whole_model():
    assert partition([node("solo")], "m", 5) == [("solo", Shard.whole("m", 5))]


def test_the_ring_is_in_node_id_order_whatever_the_memory():
    ring = partition([node("node-b", 8), node("node-a", 8), node("node-c", 16)], "m", 9)
    assert layout(ring) == [("node-a", 0, 3), ("node-b", 3, 6), ("node-c", 6, 9)]


def test_result_does_not_depend_on_input_order():
    nodes = [node("w", 24), node("x", 8), node("y", 8), node("z", 3)]
    expected = partition(nodes, "m", 13)
    for perm in itertools.permutations(nodes):
        assert partition(list(perm), "m", 13) == expected


def test_random_inputs_always_give_an_even_tiling():
    rng = random.Random(1234)
    for _ in range(500):
        n_layers = rng.randint(1, 60)
        n_nodes = rng.randint(1, min(n_layers, 10))
        ids = rng.sample([f"n{i}" for i in range(40)], n_nodes)
        mems = [rng.choice([0, rng.randint(1, 4), rng.randint(1, 64) * GB]) for _ in ids]
        nodes = [NodeCapacity(i, m) for i, m in zip(ids, mems)]
        ring = partition(nodes, "m", n_layers)

        # Tiles [0, n) in id order, one shard per node, each at least one layer, within one layer of the others.
        assert [s.start_layer for _, s in ring] == [0] + [s.end_layer for _, s in ring[:-1]]
        assert ring[-1][1].end_layer == n_layers
        assert [i for i, _ in ring] == sorted(ids)
        assert max(counts(ring).values()) - min(counts(ring).values()) <= 1


def test_random_inputs_with_more_nodes_than_layers():
    rng = random.Random(99)
    for _ in range(300):
        n_layers = rng.randint(1, 6)
        nodes = [NodeCapacity(f"n{i:02}", rng.randint(0, 5)) for i in range(rng.randint(n_layers, 10))]
        ring = partition(nodes, "m", n_layers)
        assert [i for i, _ in ring] == sorted(n.node_id for n in nodes)[:n_layers]
        assert all(s.layer_count == 1 for _, s in ring)


# --- pinned shards -----------------------------------------------------------------------------


def test_pinned_shards_that_tile_are_used_as_given_in_layer_order():
    nodes = [node("c", 1, (5, 8)), node("a", 100, (0, 2)), node("b", 1, (2, 5))]
    expected = [("a", 0, 2), ("b", 2, 5), ("c", 5, 8)]
    for perm in itertools.permutations(nodes):
        assert layout(partition(list(perm), "m", 8)) == expected


def test_unpinned_nodes_are_left_out_when_any_node_pins():
    nodes = [node("free", 512), node("a", 8, (0, 4)), node("b", 8, (4, 6))]
    assert layout(partition(nodes, "m", 6)) == [("a", 0, 4), ("b", 4, 6)]


def test_pinned_gap_is_reported_as_a_range():
    nodes = [node("a", pinned=(0, 4)), node("b", pinned=(6, 8))]
    with pytest.raises(PartitionError, match="layers 4-5 are not covered by any pinned node"):
        partition(nodes, "m", 8)


def test_pinned_missing_single_last_layer():
    with pytest.raises(PartitionError, match="layer 7 is not covered by any pinned node"):
        partition([node("a", pinned=(0, 7))], "m", 8)


def test_pinned_overlap_names_the_layers_and_both_nodes():
    nodes = [node("node-a", pinned=(0, 4)), node("node-b", pinned=(3, 8))]
    with pytest.raises(PartitionError, match="layer 3 is claimed by both node-a and node-b"):
        partition(nodes, "m", 8)


def test_pinned_overlap_by_three_nodes():
    nodes = [node("a", pinned=(0, 4)), node("b", pinned=(2, 6)), node("c", pinned=(3, 6))]
    with pytest.raises(PartitionError) as err:
        partition(nodes, "m", 6)
    msg = str(err.value)
    assert "layer 2 is claimed by both a and b" in msg
    assert "layer 3 is claimed by all of a, b and c" in msg
    assert "layers 4-5 are claimed by both b and c" in msg


@pytest.mark.parametrize("bad", [(-1, 3), (3, 3), (5, 2), (0, 9)])
def test_pinned_range_out_of_bounds_names_the_node(bad):
    nodes = [node("ok", pinned=(0, 2)), node("broken", pinned=bad)]
    with pytest.raises(PartitionError, match=r"node broken pins layers .*0 <= start < end <= 8"):
        partition(nodes, "m", 8)


def test_gap_and_overlap_are_reported_together():
    nodes = [node("a", pinned=(0, 3)), node("b", pinned=(2, 4)), node("c", pinned=(6, 8))]
    with pytest.raises(PartitionError) as err:
        partition(nodes, "m", 8)
    msg = str(err.value)
    assert "layer 2 is claimed by both a and b" in msg
    assert "layers 4-5 are not covered by any pinned node" in msg


def test_all_problems_including_a_bad_range_in_one_message():
    nodes = [node("a", pinned=(0, 3)), node("b", pinned=(2, 5)), node("c", pinned=(7, 12))]
    with pytest.raises(PartitionError) as err:
        partition(nodes, "m", 8)
    msg = str(err.value)
    assert "node c pins layers 7:12" in msg
    assert "layer 2 is claimed by both a and b" in msg
    assert "layers 5-7 are not covered" in msg


# --- bad input -----------------------------------------------------------------------------------


def test_duplicate_node_ids_are_rejected():
    with pytest.raises(PartitionError, match="duplicate node ids: a"):
        partition([node("a", 8), node("b", 8), node("a", 16)], "m", 8)


def test_duplicate_ids_are_rejected_among_pinned_nodes_too():
    with pytest.raises(PartitionError, match="duplicate"):
        partition([node("a", pinned=(0, 2)), node("a", pinned=(2, 4))], "m", 4)


def test_no_nodes_is_an_error():
    with pytest.raises(PartitionError, match="no nodes"):
        partition([], "m", 8)


@pytest.mark.parametrize("n_layers", [0, -3])
def test_a_model_needs_at_least_one_layer(n_layers):
    with pytest.raises(PartitionError, match="at least 1 layer"):
        partition([node("a")], "m", n_layers)


def test_partition_error_is_a_value_error():
    assert issubclass(PartitionError, ValueError)
