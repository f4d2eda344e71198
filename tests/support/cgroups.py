"""A CPU quota for one process, for tests that need a slower machine: a child cgroup with cgroup v2's `cpu.max`
("50000 100000": half a core), or cgroup v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us` where the cpu controller is
mounted v1 (as in many containers). Created by the test, the process moved in, removed after.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/cpu")


def _cpu_root() -> tuple[Path, str] | None:
    if (V2 / "cgroup.controllers").exists() and "cpu" in (V2 / "cgroup.controllers").read_text().split():
        return V2, "v2"
    if (V1 / "cpu.cfs_quota_us").exists():
        return V1, "v1"
    return None


def available() -> str | None:
    """None when a CPU quota can be set here, else why not."""
    if os.geteuid() != 0:
        return "CPU quotas need root"
    root = _cpu_root()
    if root is None:
        return "no cgroup cpu controller (v2 cpu.max or v1 cpu.cfs_quota_us) here"
    probe = root[0] / f"exo-probe-{uuid.uuid4().hex[:6]}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return f"cgroups are not writable here: {e}"
    return None


class CpuQuota:
    """`with CpuQuota(quota_us, period_us) as q: q.add(pid)`: the processes added share `quota_us` of CPU time
    per `period_us`; on exit they go back to the root group and the group is removed."""

    def __init__(self, quota_us: int = 50_000, period_us: int = 100_000):
        self.quota_us, self.period_us = quota_us, period_us
        root = _cpu_root()
        if root is None:
            raise RuntimeError("no cgroup cpu controller here")
        self.root, self.version = root
        self.path = self.root / f"exo-test-{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> CpuQuota:
        self.path.mkdir()
        if self.version == "v2":
            (self.path / "cpu.max").write_text(f"{self.quota_us} {self.period_us}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(self.period_us))
            (self.path / "cpu.cfs_quota_us").write_text(str(self.quota_us))
        return self

    def add(self, pid: int) -> None:
        """Move a process, all its threads with it, into the group."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def __exit__(self, *exc) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (self.root / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # it has exited
        self.path.rmdir()
