"""The entry's stall watch: a waiting request that wakes late has seen the loop stall; a request that waited
through a recent stall and then hears nothing for the grace period is lost (replayed at once); one that started
after the stall, keeps hearing, or stalls on its own pace long after it, is not."""

import pytest

from node.runtime.loop_stall import LoopStalls


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watch() -> tuple[LoopStalls, Clock]:
    clock = Clock()
    return LoopStalls(tolerance_s=2.0, grace_s=1.0, slice_s=0.5, clock=clock), clock


def test_a_request_waiting_through_a_stall_then_silent_for_the_grace_is_lost():
    stalls, clock = watch()
    started = heard = clock.now
    clock.now += 0.5 + 6.0  # a slice, woken 6 s late: the process was stopped
    stalls.woke(started)
    assert not stalls.lost(started, heard)  # not yet: what was in flight may still come
    clock.now += 1.0
    assert stalls.lost(started, heard)


def test_a_token_that_still_comes_after_the_stall_restarts_the_grace():
    stalls, clock = watch()
    started = clock.now
    clock.now += 6.5
    stalls.woke(started)
    heard = clock.now + 0.2  # in flight through the stall, delivered after it
    clock.now += 0.9
    assert not stalls.lost(started, heard)
    clock.now += 0.4
    assert stalls.lost(started, heard)


@pytest.mark.parametrize("late", [0.0, 1.9])
def test_a_wake_up_within_the_tolerance_is_no_stall(late):
    stalls, clock = watch()
    started = clock.now
    clock.now += 0.5 + late
    stalls.woke(started)
    clock.now += 5
    assert not stalls.lost(started, started)


def test_requests_started_after_a_stall_or_silent_long_after_it_are_the_plans_pace():
    stalls, clock = watch()
    clock.now += 6.5
    stalls.woke(100.0)
    fresh = clock.now + 0.1  # started after the stall: a long prefill is no loss
    clock.now += 1.5
    assert not stalls.lost(fresh, fresh)
    clock.now += 10  # the stall is long past: silence now is the idle timeouts' business
    assert not stalls.lost(100.0, 100.0)


def test_bounds_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        LoopStalls(grace_s=0)
