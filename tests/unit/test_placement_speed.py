"""Placement by measured speed (node/core/placement/balance.py): stages of equal time within each node's memory, a
node too slow to help left out, and a ring that is a pure function of the members, deaf to measurement noise and
start order. The speed itself: test_speed_report.py."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.core.placement.balance import SPEED_STEP, memory_cap
from node.core.placement.partition import NodeCapacity, PartitionError, partition

GB = 1 << 30
COSTS = [10**8] * 30  # a 30-layer model of 100M parameters a layer


def ring_of(nodes, costs=COSTS, footprints=None):
    return [(i, s.start_layer, s.end_layer) for i, s in partition(nodes, "m", len(costs), costs, footprints)]


def counts(nodes, costs=COSTS, footprints=None):
    return {i: e - s for i, s, e in ring_of(nodes, costs, footprints)}


def at(level: int) -> float:
    """The speed at the middle of a quantisation step."""
    return SPEED_STEP**level


# --- speeds ---------------------------------------------------------------------------------------------------


def test_equal_nodes_split_equally():
    assert counts([NodeCapacity(i, 8 * GB, speed=10) for i in "abc"]) == {"a": 10, "b": 10, "c": 10}


def test_a_node_at_half_speed_gets_about_half_the_layers():
    nodes = [
        NodeCapacity("a", 8 * GB, speed=10),
        NodeCapacity("b", 8 * GB, speed=10),
        NodeCapacity("c", 8 * GB, speed=5),
    ]
    assert counts(nodes) == {"a": 12, "b": 12, "c": 6}


def test_the_faster_node_takes_the_layers_that_keep_the_slowest_stage_least():
    ring = ring_of([NodeCapacity("fast", 8 * GB, speed=30), NodeCapacity("slow", 8 * GB, speed=10)])
    assert ring == [("fast", 0, 23), ("slow", 23, 30)]  # 23:7, the closest to 3:1 (as quantised: 30.9 and 9.85)


def test_a_node_too_slow_to_help_is_left_out():
    nodes = [
        NodeCapacity("a", 8 * GB, speed=10),
        NodeCapacity("b", 8 * GB, speed=10),
        NodeCapacity("c", 8 * GB, speed=0.5),
    ]
    assert counts(nodes) == {"a": 15, "b": 15}  # one layer on c would take longer than 15 on a


def test_nodes_without_a_measured_speed_count_as_the_median_of_the_others():
    nodes = [NodeCapacity("a", 8 * GB, speed=10), NodeCapacity("b", 8 * GB, speed=5), NodeCapacity("c", 8 * GB)]
    assert counts(nodes) == counts([*nodes[:2], NodeCapacity("c", 8 * GB, speed=5)])
    assert counts([NodeCapacity(i, 8 * GB) for i in "abc"]) == {"a": 10, "b": 10, "c": 10}


def test_pinned_shards_still_win_over_speeds():
    nodes = [NodeCapacity("a", 8 * GB, (0, 25), speed=0.1), NodeCapacity("b", 8 * GB, (25, 30), speed=100)]
    assert ring_of(nodes) == [("a", 0, 25), ("b", 25, 30)]


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, 1e7])
def test_a_speed_that_is_not_a_finite_positive_rate_is_refused(bad):
    with pytest.raises(ValueError, match="speed"):
        NodeCapacity("a", GB, speed=bad)


# --- memory, now a cap ------------------------------------------------------------------------------------------


def test_memory_caps_the_split_and_the_layers_go_to_nodes_with_room():
    feet = [GB] * 30  # a layer with its KV cache: 1 GiB
    nodes = [
        NodeCapacity("a", 20 * GB, speed=10),
        NodeCapacity("b", 5 * GB, speed=10),
        NodeCapacity("c", 20 * GB, speed=10),
    ]
    split = counts(nodes, footprints=feet)
    assert split["b"] <= 5 and sum(split.values()) == 30
    assert split == {"a": 13, "b": 5, "c": 12}


def test_no_split_that_fits_is_a_partition_error_that_says_the_fix():
    feet = [GB] * 30
    nodes = [NodeCapacity("a", 10 * GB, speed=10), NodeCapacity("b", 10 * GB, speed=10)]
    with pytest.raises(PartitionError, match="--memory-gb"):
        ring_of(nodes, footprints=feet)


def test_a_node_whose_memory_holds_no_layer_is_left_out():
    feet = [GB] * 30
    nodes = [NodeCapacity("a", 16 * GB), NodeCapacity("b", GB // 2), NodeCapacity("c", 16 * GB)]
    assert counts(nodes, footprints=feet) == {"a": 15, "c": 15}


def test_memory_caps_are_quantised_down():
    assert memory_cap(8 * GB + 5 * (1 << 20)) == memory_cap(8 * GB) == 8 * GB
    assert memory_cap(0) is None and memory_cap(-1) is None
    assert 0 < memory_cap(1000) <= 1000


# --- stability: a pure function of the members --------------------------------------------------------------------

node_ids = st.lists(st.text("abcdefgh", min_size=1, max_size=3), min_size=1, max_size=6, unique=True)


@st.composite
def clusters(draw):
    ids = draw(node_ids)
    return [
        NodeCapacity(
            i,
            draw(st.sampled_from([0, 4 * GB, 16 * GB, 64 * GB])),
            speed=draw(st.one_of(st.just(0.0), st.integers(-20, 40).map(at))),
        )
        for i in ids
    ]


@settings(max_examples=60, deadline=None)
@given(clusters(), st.randoms(use_true_random=False))
def test_any_order_of_the_members_gives_the_same_ring(nodes, rng):
    shuffled = list(nodes)
    rng.shuffle(shuffled)
    feet = [GB // 2] * 30
    try:
        expected = ring_of(nodes, footprints=feet)
    except PartitionError:
        with pytest.raises(PartitionError):
            ring_of(shuffled, footprints=feet)
        return
    assert ring_of(shuffled, footprints=feet) == expected
    assert [i for i, _, _ in expected] == sorted(i for i, _, _ in expected)  # the ring is in id order
    assert expected[0][1] == 0 and expected[-1][2] == 30


@settings(max_examples=60, deadline=None)
@given(clusters(), st.data())
def test_noise_within_the_quantum_does_not_move_a_layer(nodes, data):
    noisy = [
        NodeCapacity(
            n.node_id,
            n.memory_bytes + data.draw(st.integers(0, 8 << 20)) if n.memory_bytes else 0,  # a few MB more free
            speed=n.speed * data.draw(st.floats(0.96, 1.04)),  # within the step around its middle
        )
        for n in nodes
    ]
    feet = [GB // 2] * 30
    try:
        expected = ring_of(nodes, footprints=feet)
    except PartitionError:
        return
    assert ring_of(noisy, footprints=feet) == expected


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40))
def test_equal_nodes_get_layer_counts_within_one_of_each_other(n_nodes, n_layers):
    nodes = [NodeCapacity(f"n{i}", 8 * GB, speed=10) for i in range(n_nodes)]
    ring = partition(nodes, "m", n_layers)
    sizes = [s.layer_count for _, s in ring]
    assert len(ring) == min(n_nodes, n_layers) and max(sizes) - min(sizes) <= 1
