"""How many threads a ggml step should use right now: the cores of this process's affinity that other processes
leave free.

Why: ggml's CPU backend splits every op of a graph evenly over its threads and waits for all of them at a barrier
after each op (OpenMP barriers in ggml-python's build, spin-then-sleep). When another process keeps one of two
cores busy, the thread that shares that core gets a fraction of it and every op waits for it, so a node's decode
falls below what one thread alone would do (docs/benchmarks.md, a busy neighbour). So
before each step the engine asks a `ThreadGovernor`, which reads how busy the cores are (/proc/stat, less this
process's own time from /proc/self/stat) at most every `interval` seconds and answers the configured count minus
the cores other processes keep busy, at least 1. Results do not depend on the thread count (ggml gives each output
row to one thread; tested), so the choice is free to change between steps.

Where /proc is missing (macOS) the governor always answers the configured count.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

HYSTERESIS = 0.25  # cores: a change needs the others' load this far past the midpoint, so the count doesn't flap
IDLE_GAP = 0.05  # seconds between a step's end and the next one's start past which the engine counts as idle


def choose_threads(configured: int, current: int, others_busy: float) -> int:
    """The thread count for a step: `configured` less the cores other processes keep busy (`others_busy`, in
    cores, measured over this process's CPUs), rounded with hysteresis around `current`, and at least 1.

    A core counts as taken once others use more than half of it (plus HYSTERESIS to take one away, minus it to
    give one back): a thread on a core it shares waits at every barrier for its share of that core."""
    if configured < 1 or current < 1:
        raise ValueError("thread counts must be positive")
    free = configured - max(0.0, others_busy)
    target = max(1, min(configured, round(free)))
    if target < current and free > current - 0.5 - HYSTERESIS:
        return current  # not clearly busier: keep the threads
    if target > current and free < current + 0.5 + HYSTERESIS:
        return current  # not clearly freer
    return target


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU seconds: busy time of the CPUs this process may run on, and this process's own time."""

    cpus_busy: float
    own: float
    at: float  # monotonic seconds

    def __post_init__(self):
        if self.cpus_busy < 0 or self.own < 0:
            raise ValueError("CPU times are never negative")


def read_cpu_sample(cpus: frozenset[int] | None = None) -> CpuSample | None:
    """Busy seconds of `cpus` (default: this process's affinity) from /proc/stat and this process's user+system
    seconds from /proc/self/stat; None where /proc is not there."""
    try:
        with open("/proc/stat") as f:
            stat = f.read()
        with open("/proc/self/stat") as f:
            own_fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal [guest guest_nice, already inside user and nice]
        values = [int(v) for v in rest.split()[:8]]
        busy += sum(values) - values[3] - values[4]
    own = int(own_fields[11]) + int(own_fields[12])  # utime, stime (fields 14 and 15 of the whole line)
    return CpuSample(busy / tick, own / tick, time.monotonic())


def others_busy(before: CpuSample, after: CpuSample) -> float:
    """Cores other processes kept busy between two samples (this process's own time taken out)."""
    elapsed = after.at - before.at
    if elapsed <= 0:
        raise ValueError("samples must be in time order")
    return max(0.0, (after.cpus_busy - before.cpus_busy) - (after.own - before.own)) / elapsed


class ThreadGovernor:
    """The thread count for the next step (see the module docstring); `threads()` is cheap: it re-reads /proc at
    most every `interval` seconds (`adapt=False`: always the configured count). `reader` and `clock` are seams
    (tests pass recorded samples and their times).

    Only the time steps run counts (`ended` after each): after an idle gap the window starts again at the next
    step. What others did while the engine waited for work says nothing of the step about to run, and counting it
    took a node that had just watched another server answer down to one thread for its whole next prompt (half its
    speed). A neighbour that stays busy shows in the first window of steps."""

    def __init__(
        self,
        configured: int,
        interval: float = 0.5,
        reader: Callable[[], CpuSample | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        adapt: bool = True,
    ):
        if configured < 1 or interval <= 0:
            raise ValueError("a governor needs at least one thread and a positive interval")
        self.configured, self.current, self.interval = configured, configured, interval
        self.reader, self.clock = reader or (lambda: read_cpu_sample()), clock
        self.last = self.reader() if adapt and configured > 1 else None  # None: always `configured`
        self.changes = 0  # how often the count changed (a metric and a test handle)
        self._ended: float | None = None  # when the last step ended (`ended`), until the next one starts

    def ended(self) -> None:
        """A step just ended (the next `threads()` may come after an idle gap)."""
        self._ended = self.clock()

    def threads(self) -> int:
        if self.last is None:
            return self.current
        now, ended, self._ended = self.clock(), self._ended, None
        if ended is not None and now - ended > IDLE_GAP:  # idle since: the window starts again here
            self.last = self.reader() or self.last
            return self.current
        if now - self.last.at < self.interval:
            return self.current
        sample = self.reader()
        if sample is None or sample.at <= self.last.at:
            return self.current
        last, self.last = self.last, sample
        chosen = choose_threads(self.configured, self.current, others_busy(last, sample))
        if chosen != self.current:
            self.current, self.changes = chosen, self.changes + 1
        return self.current
