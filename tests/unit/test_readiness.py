"""Plans use a node only for layers it holds: the target ring once everyone holds their part, else the nodes that
can serve (node/core/placement/ring.py)."""

import pytest

from node.core.placement.partition import PartitionError
from node.core.placement.ring import plan_ring, target_ring
from node.core.topology import Availability, Capabilities, NodeInfo
from shards.model.shard import Shard

N = 6
FULL = Availability()
NOTHING = Availability(complete=False)


def node(node_id, availability=FULL, memory=1, pinned=None) -> NodeInfo:
    return NodeInfo(
        node_id,
        f"127.0.0.1:{1000 + int(node_id[-1])}",
        Capabilities(memory, "numpy", "m", N),
        pinned,
        availability=availability,
    )


def holding(*runs, embed=False, head=False) -> Availability:
    return Availability(complete=False, layers=tuple(runs), embed=embed, head=head)


def ring(nodes) -> list[tuple[str, int, int]]:
    return [(node_id, s.start_layer, s.end_layer) for node_id, s in plan_ring(nodes, "m", N)]


def test_everyone_complete_gives_the_memory_weighted_partition_as_before():
    nodes = [node("n0"), node("n1"), node("n2")]
    assert ring(nodes) == [("n0", 0, 2), ("n1", 2, 4), ("n2", 4, 6)]
    assert plan_ring(nodes, "m", N) == target_ring(nodes, "m", N)


def test_nodes_still_fetching_are_left_out_until_they_hold_their_target_part():
    fetching = [node("n0"), node("n1", NOTHING), node("n2", holding((4, 6), head=True))]
    assert ring(fetching) == [("n0", 0, 6)]  # n1 lacks 2-3: the complete node serves everything meanwhile
    ready = [node("n0"), node("n1", holding((2, 4))), node("n2", holding((4, 6), head=True))]
    assert ring(ready) == [("n0", 0, 2), ("n1", 2, 4), ("n2", 4, 6)]


def test_a_first_or_last_part_needs_the_embedding_or_the_head_too():
    no_head = [node("n0"), node("n1", holding((2, 4))), node("n2", holding((4, 6)))]
    assert ring(no_head) == [("n0", 0, 6)]
    no_embed = [node("n0", holding((0, 2))), node("n1"), node("n2")]
    assert ring(no_embed) == [("n1", 0, 3), ("n2", 3, 6)]  # the complete nodes, partitioned between themselves


def test_without_a_complete_node_a_chain_of_the_layers_held_serves():
    # the node with the files left; the two that fetched parts of a 3-way split still cover everything, though
    # not as their own 2-way target (0-2 / 3-5) wants
    nodes = [node("n1", holding((0, 4), embed=True)), node("n2", holding((4, 6), head=True))]
    assert ring(nodes) == [("n1", 0, 4), ("n2", 4, 6)]


def test_layers_nobody_holds_are_named():
    nodes = [node("n1", holding((0, 2), embed=True)), node("n2", holding((4, 6), head=True))]
    with pytest.raises(PartitionError, match="no node holds layers 2-3 yet"):
        plan_ring(nodes, "m", N)


def test_pinned_gaps_among_complete_nodes_are_still_the_pins_error():
    nodes = [node("n0", pinned=(0, 2)), node("n1", pinned=(3, 6))]
    with pytest.raises(PartitionError, match="layer 2 is not covered"):
        plan_ring(nodes, "m", N)


def test_a_pinned_node_serves_only_its_pins_in_a_fallback():
    # n1 pins 2:4 and holds it; n2 pins 4:6 but holds nothing yet; the complete n0 pins 0:2
    nodes = [node("n0", pinned=(0, 2)), node("n1", holding((2, 4)), pinned=(2, 4)), node("n2", NOTHING, pinned=(4, 6))]
    with pytest.raises(PartitionError, match="no node holds"):
        plan_ring(nodes, "m", N)


def test_availability_can_serve():
    a = holding((0, 2), (3, 6), embed=True, head=False)
    assert a.can_serve(Shard("m", 0, 2, N)) and a.can_serve(Shard("m", 3, 5, N))
    assert not a.can_serve(Shard("m", 1, 4, N))  # spans the gap at layer 2
    assert not a.can_serve(Shard("m", 3, 6, N))  # last shard without the head
    assert FULL.can_serve(Shard("m", 0, 6, N)) and not NOTHING.can_serve(Shard("m", 2, 3, N))
