"""The step scheduler: decode rows first, the token budget, prompts in chunks, length buckets and group keys."""

import numpy as np
import pytest

from node.core.scheduler import Group, Queued, SchedulerLimits, StepScheduler
from shards.model.shard import Shard

SHARD = Shard("m", 0, 4, 8)
OTHER = Shard("m", 0, 2, 8)


def prompt(rid, n, partial=False):
    return Queued(rid, np.arange(n), partial)


def decode(rid):
    return Queued(rid, np.array([7]))


def scheduler(*items, **limits):
    s = StepScheduler(SchedulerLimits(**limits))
    for item in items:
        s.push(item)
    return s


def take(s, shards=None):
    """[(shard, bucket, [(request, positions, partial), ...]), ...] for one step."""
    groups = s.take(lambda rid: (shards or {}).get(rid, SHARD))
    return [(g.shard, g.bucket, [(i.request_id, len(i.data), i.partial) for i in g.items]) for g in groups]


def test_decode_rows_go_first_then_prompt_chunks_fill_the_budget():
    s = scheduler(prompt("long", 1000), decode("d1"), decode("d2"), step_tokens=100, prefill_chunk=256)
    assert take(s) == [(SHARD, None, [("d1", 1, False), ("d2", 1, False), ("long", 98, True)])]
    assert [(i.request_id, len(i.data)) for i in s.queue] == [("long", 902)]


def test_a_prompt_is_never_truncated_every_position_is_prefilled_once_in_order():
    s = scheduler(prompt("p", 700), step_tokens=256, prefill_chunk=256)
    pieces = []
    while len(s):
        ((_, _, [(rid, n, partial)]),) = take(s)
        pieces.append((n, partial))
    assert pieces == [(256, True), (256, True), (188, False)]


def test_chunks_of_a_prompt_that_was_already_partial_stay_partial():
    s = scheduler(prompt("p", 40, partial=True), step_tokens=32, prefill_chunk=32)
    assert take(s)[0][2] == [("p", 32, True)]
    assert take(s)[0][2] == [("p", 8, True)]  # the sender has more to send after this activation


def test_decode_slots_cap_the_rows_per_step_and_the_rest_keep_their_turn():
    s = scheduler(*(decode(f"d{i}") for i in range(5)), max_batch_rows=3)
    assert [rid for rid, _, _ in take(s)[0][2]] == ["d0", "d1", "d2"]
    s.push(decode("d0"))  # d0's next token comes back after the others have waited
    assert [rid for rid, _, _ in take(s)[0][2]] == ["d3", "d4", "d0"]


def test_a_requests_inputs_run_in_order_one_per_step():
    # the prompt's last chunk is a single position: it must not overtake the chunks queued before it
    s = scheduler(prompt("p", 10, partial=True), prompt("p", 10, partial=True), decode("p"), step_tokens=64)
    assert [take(s)[0][2] for _ in range(3)] == [[("p", 10, True)], [("p", 10, True)], [("p", 1, False)]]


def test_a_step_always_runs_something_even_when_nothing_fits_the_budget():
    s = scheduler(prompt("p", 50), step_tokens=16, prefill_chunk=16, max_batch_rows=4)
    assert take(s)[0][2] == [("p", 16, True)]


def test_inputs_of_ended_requests_are_dropped():
    s = scheduler(decode("gone"), decode("live"))
    groups = s.take(lambda rid: SHARD if rid == "live" else None)
    assert [i.request_id for g in groups for i in g.items] == ["live"] and len(s) == 0


def test_requests_of_different_shards_never_share_a_call():
    s = scheduler(decode("a"), decode("b"))
    assert {(shard, tuple(r for r, _, _ in items)) for shard, _, items in take(s, {"b": OTHER})} == {
        (SHARD, ("a",)),
        (OTHER, ("b",)),
    }


# -- length buckets ------------------------------------------------------------------------------------------
BUCKETS = dict(buckets=(16, 64, 256), step_tokens=512, prefill_chunk=256)


def test_with_buckets_the_budget_is_charged_by_bucket_ceiling():
    # 17 positions pad to 64: three such prompts cost 192; a fourth of 64 would exceed 256 - 192 ... of a 256 budget
    s = scheduler(*(prompt(f"p{i}", 17) for i in range(5)), buckets=(16, 64, 256), step_tokens=256, prefill_chunk=256)
    ((_, bucket, items),) = take(s)
    assert bucket == 64 and [rid for rid, _, _ in items] == ["p0", "p1", "p2", "p3"]  # 4 x 64 = 256
    assert len(s) == 1


def test_with_buckets_long_prompts_are_cut_at_bucket_sizes_and_the_tail_padded():
    s = scheduler(prompt("p", 300), **BUCKETS)
    assert take(s) == [(SHARD, 256, [("p", 256, True)])]
    assert take(s) == [(SHARD, 64, [("p", 44, False)])]


def test_with_buckets_decode_rows_and_chunks_of_different_buckets_are_separate_calls():
    s = scheduler(decode("d"), prompt("small", 10), prompt("mid", 40), prompt("big", 200), **BUCKETS)
    assert take(s) == [
        (SHARD, 1, [("d", 1, False)]),
        (SHARD, 16, [("small", 10, False)]),
        (SHARD, 64, [("mid", 40, False)]),
        (SHARD, 256, [("big", 200, False)]),
    ]  # 337 of 512


def test_with_buckets_a_chunk_shrinks_to_the_bucket_that_fits_what_is_left():
    s = scheduler(*(decode(f"d{i}") for i in range(200)), prompt("p", 500), **BUCKETS)
    groups = take(s)
    assert groups[0][1] == 1 and len(groups[0][2]) == 64  # max_batch_rows 64 decode rows ...
    assert groups[1] == (SHARD, 256, [("p", 256, True)])  # ... 512 - 64 = 448 left: one 256 piece


@pytest.mark.parametrize(
    "limits,message",
    [
        (dict(buckets=(64, 16)), "increasing"),
        (dict(buckets=(16, 1024), step_tokens=512), "exceeds the step budget"),
        (dict(buckets=(16, 64), prefill_chunk=8), "below the smallest bucket"),
        (dict(step_tokens=0), ">= 1"),
    ],
)
def test_inconsistent_limits_are_refused(limits, message):
    with pytest.raises(ValueError, match=message):
        SchedulerLimits(**limits)


# -- prefill beside decoding streams is sized by what steps were measured to cost --------------------------------


def measured(s, decode_s, prefill_s_per_position):
    """The node ran a step of two decode rows alone, then one with a 256-position chunk beside them."""
    s.observe(group(decode("x"), decode("y")).items, decode_s)
    s.observe(group(decode("x"), decode("y"), prompt("z", 256, True)).items, decode_s + 256 * prefill_s_per_position)


def group(*items):
    return Group(SHARD, None, items)


def test_before_anything_is_measured_the_budget_alone_sizes_prefill():
    s = scheduler(decode("d"), prompt("long", 1000), step_tokens=512, prefill_chunk=256)
    assert take(s) == [(SHARD, None, [("d", 1, False), ("long", 256, True)])]


def test_beside_decode_rows_a_step_carries_only_the_prefill_that_keeps_it_within_the_stall_limit():
    # decode steps take 40 ms, a prompt position 1 ms: with max_stall 2, 40 positions double the step, no more
    s = scheduler(step_tokens=512, prefill_chunk=256, max_stall=2.0)
    measured(s, 0.040, 0.001)
    s.push(decode("d"))
    s.push(prompt("long", 1000))
    assert take(s) == [(SHARD, None, [("d", 1, False), ("long", 40, True)])]
    s = scheduler(step_tokens=512, prefill_chunk=256, max_stall=3.0)
    measured(s, 0.040, 0.001)
    s.push(decode("d"))
    s.push(prompt("long", 1000))
    assert take(s)[0][2][1] == ("long", 80, True)


def test_with_nothing_decoding_prefill_gets_the_whole_budget_whatever_it_costs():
    s = scheduler(step_tokens=512, prefill_chunk=256)
    measured(s, 0.040, 0.001)
    s.push(prompt("a", 1000))
    s.push(prompt("b", 1000))
    assert take(s) == [(SHARD, None, [("a", 256, True), ("b", 256, True)])]


def test_however_slow_prefill_is_a_prompt_still_advances_beside_decode_rows():
    s = scheduler(step_tokens=512, prefill_chunk=256)
    measured(s, 0.010, 0.050)  # one position costs five decode steps
    s.push(decode("d"))
    s.push(prompt("long", 1000))
    assert take(s)[0][2][1] == ("long", 16, True)
    s = scheduler(step_tokens=512, prefill_chunk=256, buckets=(64, 256))  # with buckets: the smallest bucket
    measured(s, 0.010, 0.050)
    s.push(decode("d"))
    s.push(prompt("long", 1000))
    assert [g[1:] for g in take(s)] == [(1, [("d", 1, False)]), (64, [("long", 64, True)])]


def test_costs_follow_the_steps_as_they_grow_slower():
    s = scheduler(step_tokens=512, prefill_chunk=256)
    measured(s, 0.040, 0.001)
    for _ in range(30):  # a long context: each position now costs 4 ms beside the decode rows
        s.observe(group(decode("x"), prompt("z", 100, True)).items, 0.040 + 100 * 0.004)
    s.push(decode("d"))
    s.push(prompt("long", 1000))
    assert take(s)[0][2][1] == ("long", 16, True)  # 10 would fit; the floor is 16


def test_a_stall_limit_at_or_below_one_decode_step_is_refused():
    with pytest.raises(ValueError, match="stall"):
        SchedulerLimits(max_stall=1.0)
