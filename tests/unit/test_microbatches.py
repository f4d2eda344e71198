"""Micro-batches round a ring (node/core/scheduler.py): a node of a ring of several stages takes its decoding
requests in batches that follow each other, so every stage computes at once; a one-node ring batches everything.

Driven through the core with plain values, as node/core is everywhere: each test queues decode inputs and reads
which requests each forward pass takes.
"""

import dataclasses

import numpy as np
import pytest

from node.core.admission import CoreLimits
from node.core.node_core import NodeCore
from node.core.requests import Activation
from node.core.scheduler import SchedulerLimits
from node.core.step_plan import StepOutputs
from tests.support.factories import CFG, hidden, logits, spec, tokens
from tests.unit.test_settings import settings


def core(node_id, **scheduling):
    return NodeCore(node_id, "llama", CFG, CoreLimits(), SchedulerLimits(**scheduling))


def passes(node):
    """The requests of every forward pass until the queue is empty (outputs fed back, nothing queued again)."""
    out = []
    while node.queue:
        (group,) = node.take_batch()
        out.append([r.request_id for r in group.rows])
        rows = {r.request_id: (hidden() if not group.shard.is_last else logits()) for r in group.rows}
        node.step_done(group, StepOutputs(rows))
    return out


def decoding(node, n, **spec_kw):
    """`n` requests whose next input (one position each) reached the middle node of a 3-node ring together."""
    node.accept_activations([Activation(f"r{i}", hidden(), spec(f"r{i}", **spec_kw)) for i in range(n)])


def test_a_ring_of_three_takes_its_decoding_requests_in_three_batches_in_arrival_order():
    b = core("b")
    decoding(b, 8)
    assert passes(b) == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6", "r7"]]
    assert b.counters["micro_batch_passes"] == 2  # the passes that left rows to the next (a status counter)


def test_batches_that_queued_up_behind_a_slow_stage_do_not_merge_again():
    b = core("b", micro_batches=2)
    decoding(b, 4)  # one batch of the two: r0 r1, and the other, r2 r3, arrived before this node took either
    b.accept_activations([Activation("r0", hidden())])  # r0's next input waits for its current one
    assert passes(b) == [["r0", "r1"], ["r2", "r3"], ["r0"]]


@pytest.mark.parametrize("batches,expected", [(1, [8]), (2, [4, 4]), (4, [2, 2, 2, 2]), (16, [1] * 8)])
def test_the_flag_sets_how_many_batches_circulate(batches, expected):
    b = core("b", micro_batches=batches)
    decoding(b, 8)
    assert [len(p) for p in passes(b)] == expected


def test_a_one_node_ring_batches_every_decoding_request_in_one_pass():
    a = core("a")
    for i in range(8):
        a.accept_prompt(spec(f"r{i}", nodes=(("a", 0, 6),), entry="a"), tokens(5))
    (group,) = a.take_batch()
    assert len(group.rows) == 8


def test_the_batch_size_follows_the_requests_held_and_never_caps_below_one_row():
    b = core("b")
    decoding(b, 2)
    assert passes(b) == [["r0"], ["r1"]]
    b.end_request("r0", "stop")
    b.accept_activations([Activation("r1", hidden())])
    assert passes(b) == [["r1"]]


def test_a_prompt_chunk_still_rides_with_a_batch_of_decode_rows():
    b = core("b")
    decoding(b, 6)
    b.accept_activations([Activation("p", hidden(5), dataclasses.replace(spec("p", max_tokens=3), prompt_tokens=5))])
    first = b.take_batch()
    assert [[r.request_id for r in g.rows] for g in first] == [["r0", "r1", "r2", "p"]]


def test_micro_batches_are_a_flag_and_nonsense_is_refused_naming_it():
    assert settings().node.scheduling.micro_batches == 0  # one batch per node of the ring
    assert settings("--micro-batches", "2").node.scheduling.micro_batches == 2
    with pytest.raises(ValueError, match="--micro-batches"):
        settings("--micro-batches", "-1")
    with pytest.raises(ValueError, match="micro_batches"):
        SchedulerLimits(micro_batches=-1)
    assert np.all([SchedulerLimits().micro_batch_rows(n, 1) is None for n in range(1, 20)])
