"""A real multi-host cluster: hosts on a private bridge, a cluster key, UDP discovery and nothing else configured.

Without a cluster key a node's gRPC listens on loopback only, so every cluster here shares a key (which also makes
it the test of a secured cluster: mutual TLS between hosts, signed announcements).

A host whose link goes down mid-request is routed around with the text unchanged: tests/multihost/
test_multihost_exact.py (link-cut) shows it on the default engine with a seeded text, the replay counted."""

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.support import netns
from tests.support.cluster import READY_API, ROOT, reference
from tests.support.models import FIXTURES
from tests.support.polling import wait_until

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=netns.available() or "")

CLIENT = (
    "import sys, urllib.request; r = urllib.request.Request(sys.argv[1], data=sys.argv[2].encode() or None, "
    "headers={'Content-Type': 'application/json'}); print(urllib.request.urlopen(r, timeout=60).read().decode())"
)
API = "http://127.0.0.1:52415"


def call(lan, i, path, body=None) -> dict:
    out = subprocess.run(
        lan.exec(i, sys.executable, "-c", CLIENT, API + path, json.dumps(body) if body else ""),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def peers_seen(lan, i) -> set[str]:
    return {n["node_id"] for n in call(lan, i, "/v1/topology")["nodes"]}


def start_hosts(lan, n: int, key, first: int = 0, extra=(), per_host=None) -> list[subprocess.Popen]:
    """Hosts first..first+n-1, started together (their imports overlap) and returned once each serves its API;
    `per_host[i]`: host i's own extra arguments."""
    procs = []
    for i in range(first, first + n):
        key_args = ["--cluster-key-file", str(key)] if key else ["--host", "0.0.0.0"]
        procs.append(
            subprocess.Popen(
                lan.exec(
                    i,
                    sys.executable,
                    "-m",
                    "node.cli",
                    "--model",
                    str(FIXTURES / "llama"),
                    "--node-id",
                    f"host{i}",
                    "--engine",
                    "numpy",
                    *key_args,
                    *("--speed", "1"),  # the hosts share this machine's cores: equal (test_multihost_placement.py)
                    *extra,
                    *(per_host or {}).get(i, ()),
                ),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for p in procs:
        for line in p.stdout:
            if READY_API.search(line):
                break
        threading.Thread(target=p.stdout.read, daemon=True).start()  # keep the pipe drained
    return procs


def stop_hosts(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_three_hosts_find_each_other_serve_and_survive_a_death(capsys, key):
    with netns.PrivateLan(3) as lan:
        started = time.monotonic()
        procs = start_hosts(lan, 3, key)
        try:
            everyone = {"host0", "host1", "host2"}
            join = wait_until(
                lambda: all(peers_seen(lan, i) == everyone for i in range(3)),
                30,
                "every host to see all three",
                interval=0.2,
            )
            join_time = time.monotonic() - started

            prompt = "The capital of France is"
            body = {
                "model": "llama",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 16,
                "temperature": 0,
            }
            expected = reference(prompt, 16)[0]
            assert call(lan, 0, "/v1/chat/completions", body)["choices"][0]["message"]["content"] == expected
            loaded = {n["node_id"]: n["loaded"] for n in call(lan, 0, "/v1/topology")["nodes"]}
            assert sum(1 for v in loaded.values() if v) >= 1

            procs[2].send_signal(signal.SIGKILL)
            procs[2].wait()
            killed = time.monotonic()
            wait_until(
                lambda: all(peers_seen(lan, i) == {"host0", "host1"} for i in range(2)),
                5 + 2,
                "the survivors to drop the dead host",
                interval=0.2,
            )
            eviction = time.monotonic() - killed
            assert call(lan, 1, "/v1/chat/completions", body)["choices"][0]["message"]["content"] == expected
            with capsys.disabled():
                print(
                    f"\n[multihost] all 3 nodes joined {join_time:.1f}s after start ({join:.1f}s after ready); "
                    f"dead node evicted in {eviction:.1f}s"
                )
        finally:
            stop_hosts(procs)
