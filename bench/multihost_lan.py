"""The hosts of the multi-host benchmarks (bench/bench_multihost*.py): network namespaces on a bridge
(tests/support/netns.py), their links, the processes on them, the caps they are held to, and what is read off them.

A link setting is a one-way delay and a rate: each host's egress (eth0) gets `netem delay D rate R` and its switch
port's egress `netem rate R`, so host to host is D one way and every host's link carries at most R in each
direction. On a kernel without sch_netem (probed by `has_netem`) the rate is shaped by htb and the delay added by
bench/delay_relay.py, a relay on every host through which its processes reach the others.

A host's caps are cgroups its processes join before their first instruction (`joined`): a CPU quota
(tests/support/cgroups.py) to make it slower, a memory limit (`MemoryCap`) to make it smaller. Every process of
host i runs on core i modulo the machine's cores (`taskset`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench.bench_rpc import process
from bench.local_cluster import ROOT

EXO_GRPC, EXO_LINK, RPC_PORT = 50051, 50075, 50100  # host i's exo node (gRPC, data link), ggml-rpc-server: + i
EXO_API, LLAMA_PORT = 52415, 8080  # on each host's own loopback
CLIENT = (
    "import asyncio, json, sys; from bench.bench_serve import concurrent; "
    "print(json.dumps(asyncio.run(concurrent(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])))))"
)
GET = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
CONNECT = "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5).close()"

NETEM = "links shaped by netem (delay and rate)"
RELAYED = (
    "this kernel has no netem: rates shaped by htb, delays added by bench/delay_relay.py on every connection between "
    "hosts (its own TCP legs are undelayed, and its threads share the hosts' cores)"
)


@dataclass(frozen=True)
class Link:
    """A host's link: `delay_ms` one way to any other host, `rate_mbit` each way."""

    delay_ms: float
    rate_mbit: float

    def __post_init__(self):
        if self.delay_ms < 0 or self.rate_mbit <= 0:
            raise ValueError(f"a link needs a delay >= 0 ms and a rate > 0 Mbit/s, got {self}")

    @property
    def label(self) -> str:
        rate = f"{self.rate_mbit / 1000:g} Gbit/s" if self.rate_mbit >= 1000 else f"{self.rate_mbit:g} Mbit/s"
        return f"{self.delay_ms:g} ms, {rate}"


def netem_commands(host: str, switch: str, port: str, link: Link, netem: bool = True) -> list[list[str]]:
    """`tc` argument vectors shaping one host: the delay on its egress only (one way between two hosts is then one
    delay, not two), the rate on both its egress and its switch port's (what the bridge sends it). `netem=False`
    (a kernel without sch_netem): the rate by htb, the delay left to bench/delay_relay.py."""
    rate = f"{link.rate_mbit:g}mbit"
    if not netem:  # htb can't be replaced by htb: remove the last setting's (a first `del` finds none: ignored)
        return [
            cmd
            for ns, dev in ((host, "eth0"), (switch, port))
            for cmd in (
                ["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"],
                ["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate],
            )
        ]
    return [
        ["tc", "-n", host, "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", f"{link.delay_ms:g}ms"]
        + ["rate", rate],
        ["tc", "-n", switch, "qdisc", "replace", "dev", port, "root", "netem", "rate", rate],
    ]


def relays(ips: list[str], i: int) -> list[str]:
    """bench/delay_relay.py's pairs on host i (no netem): each other host's exo node (gRPC and its data link), and
    from the entry host each other host's RPC worker, at its port on i's loopback, which is where i's processes
    reach it."""
    pairs = [(base + j, ip) for base in (EXO_GRPC, EXO_LINK) for j, ip in enumerate(ips) if j != i]
    pairs += [(RPC_PORT + j, ip) for j, ip in enumerate(ips) if j != i and i == 0]
    return [f"127.0.0.1:{port}={ip}:{port}" for port, ip in pairs]


def tx_counters(ip_json: str) -> tuple[int, int]:
    """(bytes, packets) sent by the link of `ip -j -s link show DEV`."""
    tx = json.loads(ip_json)[0]["stats64"]["tx"]
    return tx["bytes"], tx["packets"]


def joined(cmd: list[str], groups: list[Path]) -> list[str]:
    """`cmd` run by a shell that first joins each cgroup folder of `groups`, then becomes `cmd` (same process): every
    thread it ever starts is held by them, its start-up included."""
    if not groups:
        return cmd
    join = " && ".join(f"echo $$ > {g / 'cgroup.procs'}" for g in groups)
    return ["sh", "-c", f'{join} && exec "$@"', "sh", *cmd]


def resident(status: str) -> tuple[int, int]:
    """(resident now, peak resident) in bytes from a /proc/PID/status text."""
    kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in status.splitlines() if ":" in line)
          if k in ("VmRSS", "VmHWM")}  # fmt: skip
    if len(kb) != 2:
        raise ValueError("a /proc/PID/status text names VmRSS and VmHWM")
    return kb["VmRSS"] * 1024, kb["VmHWM"] * 1024


class MemoryCap:
    """`with MemoryCap(limit_bytes) as cap: joined(cmd, [cap.path])`: the processes in the group may hold at most
    `limit_bytes` together (cgroup v2 `memory.max`, or v1 `memory.limit_in_bytes`, page cache included: the kernel
    reclaims that first, and kills a process of the group when its own memory can't fit). Removed on exit, once
    its processes have ended."""

    V2, V1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")

    def __init__(self, limit_bytes: int):
        if limit_bytes <= 0:
            raise ValueError(f"a memory cap must be positive, got {limit_bytes} bytes")
        v2 = (self.V2 / "cgroup.controllers").exists() and "memory" in (self.V2 / "cgroup.controllers").read_text()
        if not v2 and not (self.V1 / "memory.limit_in_bytes").exists():
            raise RuntimeError("no cgroup memory controller here (v2 memory.max or v1 memory.limit_in_bytes)")
        self.limit_bytes, self.v2 = limit_bytes, v2
        self.path = (self.V2 if v2 else self.V1) / f"exo-bench-{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> MemoryCap:
        self.path.mkdir()
        (self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(str(self.limit_bytes))
        return self

    def __exit__(self, *exc) -> None:
        for _ in range(50):  # the last processes may still be exiting
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


# -- running things on the hosts ---------------------------------------------------------------------------------
def core(i: int) -> int:
    """Host i's core: its own where the machine has enough, else shared round-robin."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[i % len(cores)]


def ns_run(lan, i: int, *cmd: str, timeout: float = 1800) -> str:
    return subprocess.run(
        lan.exec(i, *cmd), cwd=ROOT, capture_output=True, text=True, check=True, timeout=timeout
    ).stdout


def ns_get(lan, i: int, url: str) -> dict | None:
    """GET `url` from inside host i (its loopback is its own); None while nothing answers there."""
    try:
        return json.loads(ns_run(lan, i, sys.executable, "-c", GET, url, timeout=30))
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return None


def listening(lan, i: int, port: int) -> bool:
    """Whether something accepts TCP on host i's loopback port."""
    try:
        ns_run(lan, i, sys.executable, "-c", CONNECT, str(port), timeout=30)
        return True
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return False


def wait_for(what: str, ready, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:g} s: see the logs in the folder printed above")
        time.sleep(1)


def has_netem(lan) -> bool:
    probe = ["tc", "-n", lan.hosts[0], "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", "0ms"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def shape(lan, link: Link, netem: bool, delay_file: Path) -> None:
    for i, host in enumerate(lan.hosts):
        for cmd in netem_commands(host, lan.switch, f"p{i}", link, netem):
            subprocess.run(cmd, check=cmd[3:5] != ["qdisc", "del"], capture_output=True)
    delay_file.write_text("0" if netem else f"{link.delay_ms:g}")
    time.sleep(0.5)  # the relays re-read it every 0.2 s


def tx(lan) -> list[tuple[int, int]]:
    run = lambda h: subprocess.run(["ip", "-n", h, "-j", "-s", "link", "show", "eth0"], capture_output=True, text=True)  # noqa: E731
    return [tx_counters(run(h).stdout) for h in lan.hosts]


def topology(lan, i: int = 0) -> dict | None:
    return ns_get(lan, i, f"http://127.0.0.1:{EXO_API}/v1/topology")


def exo_status(lan) -> list[dict]:
    """Each host's node's own status counters (the first node of its topology is itself)."""
    got = [topology(lan, i) for i in range(len(lan.hosts))]
    if None in got:
        raise RuntimeError(f"the exo node on host {got.index(None)} stopped answering: see its log")
    return [t["nodes"][0]["status"] for t in got]


def serve(lan, url: str, model_id: str, streams: int, tokens: int, round_: int) -> dict:
    """bench/bench_serve.py's `concurrent` run inside host 0 (its HTTP never crosses a link)."""
    args = (url, model_id, str(streams), str(tokens), str(round_))
    try:
        return json.loads(ns_run(lan, 0, sys.executable, "-c", CLIENT, *args))
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"the client's requests to {url} failed:\n{e.stderr[-2000:]}") from None


def start_relays(stack: contextlib.ExitStack, lan, logs: Path) -> None:
    """bench/delay_relay.py on every host (a kernel without netem), reading the delay `shape` writes. They stand for
    the links, so no cap of a host holds them (a real link isn't slowed by its machine's CPU quota)."""
    for i in range(len(lan.hosts)):
        relay = [sys.executable, "-m", "bench.delay_relay", str(logs / "delay_ms"), *relays(lan.ips, i)]
        stack.enter_context(process(lan.exec(i, *relay), core(i), logs / f"relay-{i}.log"))


def exo_node(lan, i: int, gguf: Path, netem: bool, *extra: str) -> list[str]:
    """Host i's exo node (`--threads 1 --quantize none`, static peers, no cluster key: llama.cpp RPC has no
    encryption either, so the data path goes on the data link, at a fixed port the relays carry), its API on the
    host's loopback; `extra` flags after these."""
    n = len(lan.hosts)
    reach = lambda j: "127.0.0.1" if i == j or not netem else lan.ips[j]  # noqa: E731 (host j, from host i)
    peers = ",".join(f"{reach(j)}:{EXO_GRPC + j}" for j in range(n) if j != i)
    node = [sys.executable, "-m", "node.cli", "--model", str(gguf), "--node-id", f"host{i}", "--host", lan.ips[i]]
    node += ["--advertise-host", "127.0.0.1"] if not netem else []  # peers reach it through their own relays
    node += ["--grpc-port", str(EXO_GRPC + i), "--link-port", str(EXO_LINK + i)]
    node += ["--discovery", "none", "--peers", peers, "--api-port", str(EXO_API)]
    return lan.exec(i, *node, "--quantize", "none", "--threads", "1", *extra)


def rpc_worker(lan, i: int, bin_dir: Path) -> list[str]:
    return lan.exec(i, str(bin_dir / "ggml-rpc-server"), "-H", "0.0.0.0", "-p", str(RPC_PORT + i), "-t", "1")


def rpc_addresses(lan, netem: bool) -> list[str]:
    """Every host's RPC worker as llama-server on host 0 reaches it (its own over loopback)."""
    return [f"{'127.0.0.1' if i == 0 or not netem else lan.ips[i]}:{RPC_PORT + i}" for i in range(len(lan.hosts))]


def wait_exo(lan, timeout: float = 600) -> None:
    """Until every host's node sees all of them."""
    n = len(lan.hosts)
    for i in range(n):
        wait_for(
            f"exo node on host {i}", lambda i=i: (t := topology(lan, i)) is not None and len(t["nodes"]) == n, timeout
        )
