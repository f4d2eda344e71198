"""Private test networks: Linux network namespaces joined by a bridge, created and removed by the test.

Traffic never leaves them: the bridge lives in its own namespace, not in the machine's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path


def available() -> str | None:
    """None when namespaces can be used here, else the reason they can't."""
    if os.geteuid() != 0:
        return "network namespace tests need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


def cgroup_mount() -> str:
    """A shell command mounting this machine's CPU cgroup hierarchy at /sys/fs/cgroup, as a real host has it
    (`ip netns exec` remounts /sys without it): cgroup v2's one hierarchy, or v1's cpu controller's. So a node in a
    host reads the CPU quota it runs under (node/runtime/calibration.py). Where mounting is refused, nothing."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "true"
    v1 = [c for _, c, _ in (line.split(":", 2) for line in lines) if "cpu" in c.split(",")]
    if v1:
        at = f"/sys/fs/cgroup/{v1[0]}"
        mount = f"mount -t tmpfs cgroup /sys/fs/cgroup && mkdir -p {at} && mount -t cgroup -o {v1[0]} cgroup {at}"
    else:
        mount = "mount -t cgroup2 cgroup2 /sys/fs/cgroup"
    return f"({mount}) 2>/dev/null || true"


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


class PrivateLan:
    """`n` hosts h0..h(n-1) on 10.231.X.0/24, each a namespace with one veth into a bridge namespace."""

    def __init__(self, n: int, subnet: int = 77):
        tag = uuid.uuid4().hex[:6]
        self.switch = f"exo-sw-{tag}"
        self.hosts = [f"exo-h{i}-{tag}" for i in range(n)]
        self.ips = [f"10.231.{subnet}.{10 + i}" for i in range(n)]

    def __enter__(self) -> PrivateLan:
        try:
            sh("ip", "netns", "add", self.switch)
            sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i, (host, ip) in enumerate(zip(self.hosts, self.ips)):
                sh("ip", "netns", "add", host)
                sh(
                    "ip",
                    "link",
                    "add",
                    "eth0",
                    "netns",
                    host,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    f"p{i}",
                    "netns",
                    self.switch,
                )
                sh("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
                sh("ip", "-n", host, "addr", "add", f"{ip}/24", "brd", "+", "dev", "eth0")
                sh("ip", "-n", host, "link", "set", "eth0", "up")
                sh("ip", "-n", host, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def exec(self, i: int, *cmd: str) -> list[str]:
        """Argument vector running `cmd` inside host i (the same process, after its cgroups are mounted)."""
        return ["ip", "netns", "exec", self.hosts[i], "sh", "-c", f'{cgroup_mount()}; exec "$@"', "sh", *cmd]

    def __exit__(self, *exc) -> None:
        for ns in [*self.hosts, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
