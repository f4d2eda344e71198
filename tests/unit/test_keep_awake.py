"""--keep-awake (node/runtime/keep_awake.py): while a node serves requests its idle cores spin, at the lowest priority
Linux has, one process per core it may use (at most its threads and the loop's); they stop a grace after the last
request, go on again with the next one, and never outlive the node."""

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from node.runtime.keep_awake import KeepAwake
from node.runtime.settings import NodeSettings
from node.settings import Machine, parse_args, settings_from_args
from tests.support.polling import wait_until
from tests.unit.test_gpu_memory import HOST

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")


def state(pid: int) -> str:
    """R (running or runnable), T (stopped), ... as /proc says, or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_spinners_start_with_the_first_request_at_idle_priority_and_pause_after_the_grace():
    clock = Clock()
    awake = KeepAwake(cores=8, grace_s=1.0, clock=clock)
    try:
        awake.busy(False)
        assert awake.procs == [], "spinners started before any request"
        awake.busy(True)
        assert len(awake.procs) == min(len(os.sched_getaffinity(0)), 8)
        pids = [p.pid for p in awake.procs]
        wait_until(lambda: all(os.sched_getscheduler(p) == os.SCHED_IDLE for p in pids), 10, "the spinners")
        assert {state(p) for p in pids} <= {"R", "S"}
        clock.now = 0.9
        awake.busy(False)  # within the grace: still spinning
        assert awake.running
        clock.now = 1.5
        awake.busy(False)
        wait_until(lambda: awake.busy(False) or {state(p) for p in pids} == {"T"}, 10, "the spinners stopped")
        # the next request: the same processes go on
        wait_until(lambda: awake.busy(True) or "T" not in {state(p) for p in pids}, 10, "the spinners going on")
        assert [p.pid for p in awake.procs] == pids
    finally:
        awake.close()
    assert {state(p) for p in pids} == {"gone"}


def test_one_spinner_per_core_the_node_may_use_at_most_its_threads_and_the_loops():
    awake = KeepAwake(cores=1)
    assert awake.count() == 1
    assert KeepAwake(cores=1000).count() == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="at least one core"):
        KeepAwake(cores=0)


def test_spinners_die_with_their_node_even_when_stopped():
    code = (
        "import sys, time; from node.runtime.keep_awake import KeepAwake; "
        "a = KeepAwake(cores=2, grace_s=0); a.busy(True)\n"
        "while not a.procs or not all(a._stopped.values()):\n"  # each spinner ready, then stopped (SIGSTOP)
        "    time.sleep(0.05); a.busy(False)\n"
        "print(' '.join(str(p.pid) for p in a.procs), flush=True); time.sleep(60)"
    )
    node = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in node.stdout.readline().split()]
        assert pids
        wait_until(lambda: {state(p) for p in pids} == {"T"}, 10, "the spinners stopped")
        node.send_signal(signal.SIGKILL)  # no chance to clean up
        node.wait()
        wait_until(lambda: all(state(p) in ("gone", "Z") for p in pids), 10, "the spinners")
    finally:
        node.kill()
        node.wait()


def test_the_flag_gives_the_engines_threads_and_the_loops_cores_and_off_is_zero():
    def parsed(*flags):
        return settings_from_args(parse_args(["--engine", "ggml", *flags]), machine=Machine(**HOST)).node.keep_awake

    assert parsed() == 0
    assert parsed("--keep-awake", "--threads", "3") == 4
    with pytest.raises(ValueError, match="count of cores"):
        NodeSettings(node_id="n", memory_bytes=1, keep_awake=-1)


def test_busy_ticks_start_no_more_processes_once_they_run():
    awake = KeepAwake(cores=1)
    try:
        for _ in range(100):
            awake.busy(True)
        assert len(awake.procs) == 1
    finally:
        awake.close()


def test_a_nodes_tick_starts_them_with_its_requests_and_its_stop_ends_them():
    async def go():
        awake, serving = KeepAwake(cores=1, grace_s=0), [False]
        task = asyncio.ensure_future(awake.run(lambda: serving[0], tick_s=0.01))
        await asyncio.sleep(0.05)
        assert awake.procs == []
        serving[0] = True
        while not awake.procs:
            await asyncio.sleep(0.01)
        pids = [p.pid for p in awake.procs]
        task.cancel()  # the node stops
        await asyncio.gather(task, return_exceptions=True)
        return pids

    pids = asyncio.run(go())
    assert {state(p) for p in pids} == {"gone"}
