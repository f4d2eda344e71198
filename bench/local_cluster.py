"""Start real `exo-node` processes on loopback; always kill and reap them.

The one launcher for the benchmarks here and the tests (tests/support/cluster.py re-uses it): bench/ never imports
tests/, so what both need lives on this side.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READY_GRPC = re.compile(r"exo-node (\S+): gRPC listening on (\S+)")
READY_API = re.compile(r"exo-node (\S+): API listening on (\S+)")
LEAVE_GRACE = 2.0  # seconds a stopping node has to leave on its own (an idle one takes ~1.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class NodeProc:
    proc: subprocess.Popen
    grpc_port: int
    node_id: str = ""
    api_url: str | None = None
    lines: list[str] = field(default_factory=list)

    def log(self) -> str:
        return "".join(self.lines)


def http(
    method: str, url: str, body: dict | None = None, timeout: float = 60, key: str | None = None
) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_settled(url: str, timeout: float = 60, key: str | None = None) -> None:
    """Poll the node at `url` until every node of its topology says its start-up's work on the engine thread is
    over (`startup_done` in its status: calibration, and under --speed the draft rows' pricing, which waits for the
    first request to have loaded a shard and ended). A benchmark calls this after its warm-up request, so that work
    lands in no timed round, its own or another server's on the same cores."""
    deadline = time.monotonic() + timeout
    while True:
        status, topology = http("GET", f"{url}/v1/topology", key=key)
        nodes = (topology.get("nodes") or []) if status == 200 else []
        if nodes and all(n.get("status", {}).get("startup_done") for n in nodes):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{url}: a node's start-up work (startup_done in its status) did not end in {timeout:g}s"
            )
        time.sleep(0.2)


class Cluster:
    """`with Cluster(model_dir, n=3, shards=[...]) as c:` -> n nodes, each peered with all others."""

    def __init__(
        self,
        model_dir: Path,
        n: int,
        shards: list[str] | None = None,
        memory_gb: list[float] | None = None,
        extra: list[str] | None = None,
        api_nodes: int | None = None,
        api_key: str | None = None,
        static_peers: bool = True,
        ports: list[int] | None = None,
        per_node: list[list[str]] | None = None,
        model_id: str | None = None,
        entry_late_by: float = 0,
        engine: str | None = "numpy",
        calibrate: bool = False,
    ):
        self.model_dir, self.n, self.api_key, self.static_peers = model_dir, n, api_key, static_peers
        self.model_id = model_id or Path(model_dir).name  # the API's model id (a packaged model's differs)
        self.shards, self.memory_gb, self.extra = shards, memory_gb, extra or []
        self.api_nodes = n if api_nodes is None else api_nodes
        self.nodes: list[NodeProc] = []
        self.ports = ports or []
        self.per_node = per_node  # extra arguments for each node
        self.entry_late_by = entry_late_by  # start node0 this long after the others (they retry reaching it)
        # Nodes run the numpy engine unless a test says otherwise (engine=None: the node's default, `auto`): the
        # cluster tests compare against float32 references token for token.
        self.engine = engine
        self.calibrate = calibrate  # nodes measure their own speed (else --speed 1: see _start)

    def __enter__(self) -> Cluster:
        try:
            ports = self.ports = self.ports or [free_port() for _ in range(self.n)]
            order = [*range(1, self.n), 0] if self.entry_late_by else range(self.n)
            started = {}
            for i in order:
                if i == 0 and self.entry_late_by:
                    time.sleep(self.entry_late_by)
                started[i] = self._start(i, ports[i], [p for p in ports if p != ports[i]])
            self.nodes.extend(started[i] for i in range(self.n))
            for node in self.nodes:
                self._wait_ready(node)
            self.wait_for_peers()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self, i: int, port: int, peer_ports: list[int]) -> NodeProc:
        args = [
            sys.executable,
            "-m",
            "node.cli",
            "--model",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--grpc-port",
            str(port),
            "--node-id",
            f"node{i}",
            "--log-level",
            "warning",
            "--discovery",
            "none",
        ]  # tests never broadcast on the machine's real network
        if self.static_peers:
            args += ["--peers", ",".join(f"127.0.0.1:{p}" for p in peer_ports)]
        args += ["--api-port", "0"] if i < self.api_nodes else ["--no-api"]
        if self.shards:
            args += ["--shard", self.shards[i]]
        if self.memory_gb:
            args += ["--memory-gb", str(self.memory_gb[i])]
        if self.api_key:
            args += ["--api-key", self.api_key]
        if self.per_node:
            args += self.per_node[i]
        if self.engine and "--engine" not in args + self.extra:
            args += ["--engine", self.engine]
        # nodes sharing one machine's cores are equal: what they'd measure is each other's load, and placement
        # would follow that noise
        if not self.calibrate and "--speed" not in args + self.extra:
            args += ["--speed", "1"]
        proc = subprocess.Popen(
            args + self.extra,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        node = NodeProc(proc, port)
        threading.Thread(target=self._pump, args=(node,), daemon=True).start()
        return node

    @staticmethod
    def _pump(node: NodeProc) -> None:
        for line in node.proc.stdout:
            node.lines.append(line)
            if m := READY_GRPC.search(line):
                node.node_id = m.group(1)
            if m := READY_API.search(line):
                node.api_url = m.group(2)

    def _wait_ready(self, node: NodeProc, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        want_api = self.nodes.index(node) < self.api_nodes
        while not (node.node_id and (node.api_url or not want_api)):
            if node.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node did not start:\n{node.log()}")
            time.sleep(0.05)

    def wait_for_peers(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        for node in self.nodes[: self.api_nodes]:
            while len(self.topology(node)["nodes"]) < self.n:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{node.node_id} does not see all peers: {self.topology(node)}")
                time.sleep(0.1)

    def topology(self, node: NodeProc | None = None) -> dict:
        return http("GET", f"{(node or self.nodes[0]).api_url}/v1/topology", key=self.api_key)[1]

    def chat(self, messages: list[dict] | str, node: NodeProc | None = None, **params) -> tuple[int, dict]:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        body = {"model": self.model_id, "messages": messages, **params}
        return http("POST", f"{(node or self.nodes[0]).api_url}/v1/chat/completions", body, key=self.api_key)

    def self_info(self) -> dict[str, dict]:
        """Each node's own fresh view of itself (a peer's view of it lags by a health-check interval)."""
        return {n.node_id: self.topology(n)["nodes"][0] for n in self.nodes if n.api_url and n.proc.poll() is None}

    def active_requests(self) -> dict[str, int]:
        return {node_id: info["active_requests"] for node_id, info in self.self_info().items()}

    def wait_idle(self, timeout: float = 10) -> dict[str, int]:
        """Poll until no node holds per-request state (releases are asynchronous); returns the last counts."""
        deadline = time.monotonic() + timeout
        while any((counts := self.active_requests()).values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return counts

    def wait_calibrated(self, timeout: float = 30) -> None:
        """Poll until every node with an API ended its start-up speed calibration (`calibration_done` in its status):
        its rounds build and drop an engine of their own over a few seconds after start, which a memory figure
        taken before then would count."""
        deadline = time.monotonic() + timeout
        while not all(info["status"].get("calibration_done") for info in self.self_info().values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"a node did not end its calibration within {timeout:g}s")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        """SIGTERM every node; one still draining after LEAVE_GRACE seconds gets the second SIGTERM that cuts its
        drain short (node/cli.py's `drain`): a node whose send to a dead or frozen peer is pending would otherwise
        wait for that call's deadline (~10 s) before it exits. Tests of a node's own drain signal it themselves."""
        for node in self.nodes:
            if node.proc.poll() is None:
                node.proc.terminate()
        deadline = time.monotonic() + LEAVE_GRACE
        for node in self.nodes:
            try:
                node.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.proc.terminate()
        for node in self.nodes:
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()
