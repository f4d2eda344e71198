"""The ggml engine's thread count follows the cores other processes leave free (shards/engines/ggml/threads.py)."""

from __future__ import annotations

import time

import pytest

from shards.engines.ggml.threads import CpuSample, ThreadGovernor, choose_threads, others_busy, read_cpu_sample


@pytest.mark.parametrize("others,expected", [(0.0, 2), (0.6, 2), (0.8, 1), (1.0, 1), (2.0, 1), (5.0, 1)])
def test_two_threads_drop_to_one_once_another_process_clearly_takes_a_core(others, expected):
    assert choose_threads(2, 2, others) == expected


@pytest.mark.parametrize("others,expected", [(1.0, 1), (0.3, 1), (0.2, 2), (0.0, 2)])
def test_one_thread_comes_back_only_once_the_core_is_clearly_free(others, expected):
    assert choose_threads(2, 1, others) == expected


def test_never_more_than_configured_nor_fewer_than_one():
    assert choose_threads(8, 8, 0.0) == 8
    assert choose_threads(8, 8, 3.0) == 5
    assert choose_threads(8, 5, 100.0) == 1
    with pytest.raises(ValueError):
        choose_threads(0, 1, 0.0)


def test_others_busy_is_the_cpus_busy_time_less_our_own_per_second():
    before, after = CpuSample(10.0, 3.0, at=100.0), CpuSample(13.5, 4.5, at=102.0)
    assert others_busy(before, after) == pytest.approx((3.5 - 1.5) / 2)
    assert others_busy(after, CpuSample(14.0, 5.0, at=103.0)) == 0.0  # all of it ours
    with pytest.raises(ValueError):
        others_busy(after, before)


class Recorded:
    """CPU samples as /proc would give them, with a clock the test advances."""

    def __init__(self):
        self.now, self.busy, self.own, self.reads = 0.0, 0.0, 0.0, 0

    def run(self, seconds: float, others: float, ours: float) -> None:
        self.now += seconds
        self.busy += (others + ours) * seconds
        self.own += ours * seconds

    def __call__(self) -> CpuSample:
        self.reads += 1
        return CpuSample(self.busy, self.own, self.now)


def test_the_governor_follows_a_neighbour_that_comes_and_goes_deciding_once_its_window_spans_the_interval():
    cpu = Recorded()
    gov = ThreadGovernor(2, interval=0.5, reader=cpu, clock=lambda: cpu.now)
    cpu.run(1.0, others=0.0, ours=2.0)
    assert gov.threads() == 2
    cpu.run(1.0, others=1.0, ours=1.0)  # a neighbour spins on one core
    assert gov.threads() == 1
    reads = cpu.reads
    cpu.run(0.02, others=0.0, ours=1.0)
    assert gov.threads() == 1 and cpu.reads == reads  # within IDLE_GAP of the last read: none
    cpu.run(0.1, others=0.0, ours=1.0)
    assert gov.threads() == 1 and cpu.reads == reads + 1  # read, but 0.12 s is no window to decide on
    cpu.run(1.0, others=0.0, ours=1.0)  # the neighbour is gone
    assert gov.threads() == 2 and gov.changes == 2


def test_what_others_did_while_this_node_was_idle_leaves_its_threads_alone():
    """A prefill benchmark's node, idle while another server answered on both cores, ran its next prompt on one
    thread (at half speed): the window it measured was all the other server's work. Only the time its steps run
    counts now: after an idle gap the window starts again; a neighbour that is still busy shows in the first window
    of steps."""
    cpu = Recorded()
    gov = ThreadGovernor(2, interval=0.5, reader=cpu, clock=lambda: cpu.now)

    def step(seconds: float, others: float) -> int:
        threads = gov.threads()
        cpu.run(seconds, others=others, ours=float(threads))
        gov.ended()
        return threads

    assert step(1.0, others=0.0) == 2
    cpu.run(3.3, others=2.0, ours=0.0)  # another server answers on both cores; this node waits for a request
    assert [step(0.3, others=0.0) for _ in range(4)] == [2, 2, 2, 2]
    cpu.run(2.0, others=1.0, ours=0.0)  # idle again, and a neighbour takes a core and keeps it
    assert [step(0.3, others=1.0) for _ in range(3)] == [2, 2, 1]  # seen in the first window of steps
    cpu.run(0.01, others=0.0, ours=0.0)  # a gap too short to be idle: the window goes on
    assert step(0.3, others=1.0) == 1 and gov.changes == 1


def test_a_ring_node_that_waits_between_its_steps_still_hears_a_busy_neighbour():
    """A node of a ring waits for its peers between steps (idle gaps) while a game keeps a core: the busy parts
    add up across the gaps until they span the interval, and the node drops to one thread."""
    cpu = Recorded()
    gov = ThreadGovernor(2, interval=0.5, reader=cpu, clock=lambda: cpu.now)
    counts = []
    for _ in range(6):
        counts.append(gov.threads())
        cpu.run(0.2, others=1.0, ours=float(counts[-1]))  # a step of 0.2 s beside the neighbour
        gov.ended()
        cpu.run(0.3, others=1.0, ours=0.0)  # waiting for the peer
    assert counts == [2, 2, 2, 1, 1, 1]  # the third step's end: 0.6 s of steps seen


def test_a_process_pinned_to_fewer_cores_while_it_runs_starts_a_new_baseline():
    """Busy time is summed over the process's CPUs as they are at each read: pinned to one of two cores mid-run
    (`taskset -p`), the next read counts less busy time than the last. That is no negative load (it once failed
    the pass that read it: "CPU times are never negative"): the window goes on from the new count."""
    cpu = Recorded()
    cpu.busy = 5000.0  # the CPUs' busy seconds since boot
    gov = ThreadGovernor(2, interval=0.5, reader=cpu, clock=lambda: cpu.now)
    cpu.run(0.3, others=0.0, ours=2.0)
    assert gov.threads() == 2
    cpu.busy /= 2  # the second core no longer counted
    cpu.run(0.3, others=0.0, ours=1.0)
    assert gov.threads() == 2
    for _ in range(4):
        cpu.run(0.3, others=1.0, ours=1.0)  # then a neighbour on the other counted core
        gov.threads()
    assert gov.current == 1


def test_a_fixed_governor_or_one_thread_never_reads_proc():
    cpu = Recorded()
    for gov in (
        ThreadGovernor(2, reader=cpu, clock=lambda: cpu.now, adapt=False),
        ThreadGovernor(1, reader=cpu, clock=lambda: cpu.now),
    ):
        cpu.run(1.0, others=2.0, ours=0.0)
        assert gov.threads() == gov.configured
    assert cpu.reads == 0


def test_this_machine_has_proc_or_the_governor_keeps_the_configured_count():
    sample = read_cpu_sample()
    if sample is None:  # no /proc (macOS)
        assert ThreadGovernor(2).threads() == 2
    else:
        assert sample.cpus_busy > 0 and sample.own > 0  # this process has run, on these CPUs


def test_a_sample_counts_this_processs_own_work_and_leaves_it_out_of_the_others():
    """What this process computes between two samples shows in `own` and in the CPUs' busy time alike, so it is
    never taken for another process keeping a core busy (the reads repeat every IDLE_GAP: /proc/stat through one
    descriptor kept open)."""
    before = read_cpu_sample()
    if before is None:
        pytest.skip("no /proc here")
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # a core's worth of our own work
        pass
    after = read_cpu_sample()
    assert after.own - before.own >= 0.2
    assert after.cpus_busy - before.cpus_busy >= 0.2
    assert read_cpu_sample(frozenset()).cpus_busy == 0.0  # no CPU of ours: nothing of theirs counted either
