"""How many threads a ggml step should use right now: the cores of this process's affinity that other processes
leave free.

Why: ggml's CPU backend splits every op of a graph evenly over its threads and waits for all of them at a barrier
after each op (OpenMP barriers in ggml-python's build, spin-then-sleep). When another process keeps one of two
cores busy, the thread that shares that core gets a fraction of it and every op waits for it, so a node's decode
falls below what one thread alone would do (docs/benchmarks.md, a busy neighbour). So
before each step the engine asks a `ThreadGovernor`, which reads how busy the cores are while steps run (/proc/stat,
less this process's own time), decides over every `interval` seconds of them and answers the
configured count minus the cores other processes keep busy, at least 1. Results do not depend on the thread count (ggml gives each output
row to one thread; tested), so the choice is free to change between steps.

Where /proc is missing (macOS) the governor always answers the configured count.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

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


EMPTY = CpuSample(0.0, 0.0, 0.0)  # no CPU time yet: where a governor's window of summed busy time starts


def read_cpu_sample(cpus: frozenset[int] | None = None) -> CpuSample | None:
    """Busy seconds of `cpus` (default: this process's affinity) from /proc/stat and this process's user+system
    seconds (`os.times`, the same clock ticks /proc/self/stat counts); None where /proc is not there. /proc/stat is
    read through one descriptor kept open (a positioned read: the engine thread samples every IDLE_GAP)."""
    try:
        stat = os.pread(_proc_stat(), 1 << 18, 0).decode()
    except OSError:
        return None
    cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu"):
            break  # the cpu lines come first
        if name == "cpu" or int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal [guest guest_nice, already inside user and nice]
        values = [int(v) for v in rest.split()[:8]]
        busy += sum(values) - values[3] - values[4]
    own = os.times()
    return CpuSample(busy / tick, own.user + own.system, time.monotonic())


@cache
def _proc_stat() -> int:
    """The descriptor of /proc/stat, opened once per process (OSError where there is none)."""
    return os.open("/proc/stat", os.O_RDONLY | os.O_CLOEXEC)


def others_busy(before: CpuSample, after: CpuSample) -> float:
    """Cores other processes kept busy between two samples (this process's own time taken out)."""
    elapsed = after.at - before.at
    if elapsed <= 0:
        raise ValueError("samples must be in time order")
    return max(0.0, (after.cpus_busy - before.cpus_busy) - (after.own - before.own)) / elapsed


class ThreadGovernor:
    """The thread count for the next step (see the module docstring); `threads()` is cheap: it reads /proc at most
    every IDLE_GAP seconds (`adapt=False`: always the configured count). `reader` and `clock` are seams (tests pass
    recorded samples and their times).

    Only the time steps run counts: the engine says when each ends (`ended`), and when the next starts after an
    idle gap the gap is left out. The busy windows add up until they span `interval`, then decide. What others did
    while the engine waited for work says nothing of the step about to run: counting it took a node that had just
    watched another server answer down to one thread for its whole next prompt (half its speed). And a ring's node
    that waits for its peers between steps still hears a neighbour that keeps a core busy while its steps run."""

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
        self._window = EMPTY  # the busy windows so far, summed (`at`: the seconds they span)

    def ended(self) -> None:
        """A step just ended (the next `threads()` may come after an idle gap)."""
        self._ended = self.clock()
        if self.last is not None and self._ended - self.last.at >= IDLE_GAP:
            self._add()

    def threads(self) -> int:
        if self.last is None:
            return self.current
        now, ended, self._ended = self.clock(), self._ended, None
        if ended is not None and now - ended > IDLE_GAP:  # idle since the last step: the gap is left out
            self.last = self.reader() or self.last
        elif now - self.last.at >= IDLE_GAP:
            self._add()
        return self.current

    def _add(self) -> None:
        """The time since the last sample, busy, added to the window; a decision once it spans `interval`."""
        sample = self.reader()
        if sample is None or sample.at <= self.last.at:
            return
        last, self.last, w = self.last, sample, self._window
        if sample.cpus_busy < last.cpus_busy or sample.own < last.own:
            return  # counted over other CPUs now (the process was pinned, say): a new baseline, nothing to add
        w = self._window = CpuSample(
            w.cpus_busy + sample.cpus_busy - last.cpus_busy, w.own + sample.own - last.own, w.at + sample.at - last.at
        )
        if w.at < self.interval:
            return
        chosen = choose_threads(self.configured, self.current, others_busy(EMPTY, w))
        self._window = EMPTY
        if chosen != self.current:
            self.current, self.changes = chosen, self.changes + 1
