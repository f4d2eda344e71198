"""`--keep-awake`: while the node serves requests, its idle cores spin at the lowest priority there is, so a message
that arrives finds them awake.

A ring at one stream leaves each node idle while the others compute, and an idle core halts. Waking a halted core
takes a hardware interrupt, and on a virtual machine a trip through the hypervisor, which can cost more than the
hop itself; a token wakes each node of the ring once, and the cache a pass finds is colder. Spinners keep the core
busy instead: SCHED_IDLE processes run only where nothing else wants the core and yield it the moment anything
does, so they take no time from the node or its neighbours, only the power of otherwise idle cores. That is the
price, and why it is off by default: a laptop's fan, a shared machine's bill.

Processes, not threads: a spinning thread would hold the interpreter's lock. They inherit the node's CPU affinity
when first needed (so a node pinned after start keeps its spinners on its own cores), one per core the node may
use up to its threads, are stopped (SIGSTOP) when the node has had no request for `grace_s`, and die with it
(PR_SET_PDEATHSIG, and a check of their parent). Linux only.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

# the spinner: lowest priority, killed with its parent, says it is ready (only then may it be stopped: stopped
# before, it would never learn its parent died), then spins, looking up every few million iterations
_SPIN = """
import ctypes, os, sys
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
parent = int(sys.argv[1])
print("ready", flush=True)
while os.getppid() == parent:
    for _ in range(2_000_000):
        pass
"""


def supported() -> str | None:
    """Why spinners can't run here, or None."""
    if not sys.platform.startswith("linux") or not hasattr(os, "SCHED_IDLE"):
        return "--keep-awake needs Linux (SCHED_IDLE): leave it out on this system"
    return None


class KeepAwake:
    def __init__(self, cores: int, grace_s: float = 1.0, clock=time.monotonic):
        """`cores`: the most cores to keep awake (the engine's threads and the event loop's); `grace_s`: how long
        after the last request the spinners go on."""
        if why := supported():
            raise ValueError(why)
        if cores < 1:
            raise ValueError(f"keep-awake needs at least one core, got {cores}")
        self.cores, self.grace_s, self.clock = cores, grace_s, clock
        self.procs: list[subprocess.Popen] = []
        self._stopped: dict[int, bool | None] = {}  # by pid; None until the spinner said it is ready
        self.running = False  # whether the spinners should spin
        self._last_busy = float("-inf")

    def count(self) -> int:
        """One spinner per core this process may run on (its affinity now), at most `cores`."""
        return min(len(os.sched_getaffinity(0)), self.cores)

    def busy(self, active: bool) -> None:
        """Called often (`run`'s tick): whether the node serves a request right now."""
        now = self.clock()
        if active:
            self._last_busy = now
            self.running = True
        elif now - self._last_busy > self.grace_s:
            self.running = False
        if self.running and not self.procs:
            me = str(os.getpid())
            for _ in range(self.count()):
                p = subprocess.Popen(
                    [sys.executable, "-c", _SPIN, me], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE
                )
                os.set_blocking(p.stdout.fileno(), False)
                self.procs.append(p)
                self._stopped[p.pid] = None  # not ready yet
        for p in self.procs:
            if self._stopped[p.pid] is None:
                if not self._ready(p):
                    continue
                self._stopped[p.pid] = False
            if self._stopped[p.pid] == self.running and p.poll() is None:
                p.send_signal(signal.SIGCONT if self.running else signal.SIGSTOP)
                self._stopped[p.pid] = not self.running

    @staticmethod
    def _ready(p: subprocess.Popen) -> bool:
        try:
            return bool(p.stdout.read())
        except (BlockingIOError, ValueError):
            return False

    async def run(self, active: Callable[[], bool], tick_s: float = 0.1) -> None:
        """Look every `tick_s` whether the node serves a request (`active`), until cancelled; then close."""
        try:
            while True:
                self.busy(active())
                await asyncio.sleep(tick_s)
        finally:
            self.close()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
            p.stdout.close()
        self.procs, self._stopped, self.running = [], {}, False
