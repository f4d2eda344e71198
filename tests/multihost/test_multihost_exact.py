"""Faults between hosts on the default engine: the packaged SmolLM2 on ggml as a node runs it by default (F16 weights,
`--float-matmul pad`), three hosts on a private bridge with a cluster key. The middle host of the request's plan is
killed (-9), frozen (SIGSTOP) or cut off the network while a seeded completion is being generated; the entry
replays prompt + generated tokens as one prefill on the survivors, and the text is the undisturbed run's, character
for character (before the replay was made exact, 5 of 5 such texts changed after the fault).

The three faults share one private network and its hosts (a module fixture): after each, the victim is killed if
it still runs, its link brought back up and a fresh process started on it under the same name, which rejoins; the
next fault waits for a plan through all three again. The fault comes after a given number of streamed tokens
(not after a guessed delay), so it always lands mid-request."""

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest

from shards.formats.packaged import DEFAULT_MODEL, resolve_model
from tests.multihost.test_multihost import call, peers_seen, stop_hosts
from tests.support import netns
from tests.support.cluster import READY_API, ROOT
from tests.support.polling import wait_until

pytest.importorskip("ggml", reason="the ggml extra is not installed")
pytestmark = pytest.mark.skipif(netns.available() is not None, reason=netns.available() or "")

HOSTS = {"host0", "host1", "host2"}
FAULTS = ("kill-9", "sigstop", "link-cut")
FAULT_AFTER = 20  # streamed tokens before the fault: the replay prefills prompt + these
STREAM = (
    "import json, sys\n"
    "from tests.support.http import stream_completion\n"
    "for e in stream_completion(sys.argv[1], json.loads(sys.argv[2]), timeout=90):\n"
    "    print(json.dumps({'text': e.text, 'error': e.error}), flush=True)\n"
)
API = "http://127.0.0.1:52415/v1/completions"


def start_default_host(lan, key, i: int) -> subprocess.Popen:
    path, _ = resolve_model(DEFAULT_MODEL)
    return subprocess.Popen(
        lan.exec(
            i,
            sys.executable,
            "-m",
            "node.cli",
            "--model",
            str(path),
            "--node-id",
            f"host{i}",
            "--threads",
            "1",
            "--memory-gb",
            "2",
            "--speed",
            "1",  # equal shares: the plan runs through all three
            "--cluster-key-file",
            str(key),
        ),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_serving(procs) -> None:
    for p in procs:
        for line in p.stdout:
            if READY_API.search(line):
                break
        threading.Thread(target=p.stdout.read, daemon=True).start()  # keep the pipe drained


def stream(lan, entry: int, body: dict, on_event=lambda n: None) -> tuple[str, list]:
    """A streamed completion asked of host `entry` from inside its namespace: (text, in-band errors);
    `on_event(n)` runs after the n-th event has arrived."""
    client = subprocess.Popen(
        lan.exec(entry, sys.executable, "-c", STREAM, API, json.dumps(body)),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    texts, errors = [], []
    for n, line in enumerate(client.stdout, 1):
        event = json.loads(line)
        texts.append(event["text"])
        if event["error"]:
            errors.append(event["error"])
        on_event(n)
    assert client.wait(timeout=90) == 0, client.stderr.read()
    return "".join(texts), errors


@dataclass
class Ring:
    lan: netns.PrivateLan
    key: object
    procs: list[subprocess.Popen] = field(default_factory=list)
    expected: str = ""
    faulted: set[int] = field(default_factory=set)  # hosts a test faulted: restarted before the next test

    def heal(self) -> None:
        """Each faulted host's process killed (a stopped one too), its link up again, a fresh one in its place."""
        for i in sorted(self.faulted):
            if self.procs[i].poll() is None:
                self.procs[i].send_signal(signal.SIGKILL)
            self.procs[i].wait()
            netns.sh("ip", "-n", self.lan.hosts[i], "link", "set", "eth0", "up")
            self.procs[i] = start_default_host(self.lan, self.key, i)
        wait_serving([self.procs[i] for i in sorted(self.faulted)])
        self.faulted.clear()


def body(**overrides) -> dict:
    return {
        "model": resolve_model(DEFAULT_MODEL)[1],
        "prompt": "The old lighthouse keeper climbed the stairs and",
        "max_tokens": 40,  # 20 tokens after the fault
        "temperature": 0.8,
        "seed": 5,
    } | overrides


@pytest.fixture(scope="module")
def ring(key):
    with netns.PrivateLan(3, subnet=81) as lan:
        r = Ring(lan, key)
        try:
            r.procs = [start_default_host(lan, key, i) for i in range(3)]
            wait_serving(r.procs)
            wait_until(lambda: peers_seen(lan, 0) == HOSTS, 30, "host0 to see all three", interval=0.2)
            r.expected, errors = stream(lan, 0, body())  # the undisturbed text (layers load as it runs)
            assert errors == []
            yield r
        finally:
            stop_hosts(r.procs)


def fault(kind: str, lan, procs, victim: int) -> None:
    if kind == "kill-9":
        procs[victim].send_signal(signal.SIGKILL)
    elif kind == "sigstop":
        procs[victim].send_signal(signal.SIGSTOP)
    else:
        netns.sh("ip", "-n", lan.hosts[victim], "link", "set", "eth0", "down")


def replays(lan, i: int) -> int:
    return call(lan, i, "/v1/topology")["nodes"][0]["status"].get("replays", 0)


@pytest.mark.parametrize("kind", FAULTS)
def test_a_fault_of_the_middle_host_leaves_a_seeded_text_on_the_default_engine_unchanged(kind, capsys, ring):
    ring.heal()
    lan, seen = ring.lan, {}

    def plan_through_all_three() -> bool:
        seen["topology"] = t = call(lan, 0, "/v1/topology")
        return {n["node_id"] for n in t["nodes"] if n["loaded"]} == HOSTS and len(t["plan"] or []) == 3

    wait_until(lambda: peers_seen(lan, 0) == HOSTS, 30, "host0 to see all three", interval=0.2)
    if not plan_through_all_three():  # a host restarted after the last fault loads its layers for a request
        assert stream(lan, 0, body(max_tokens=1))[1] == []
    try:
        wait_until(plan_through_all_three, 30, "a plan through all three hosts", interval=0.2)
    except AssertionError as e:
        raise AssertionError(f"{e}: {seen.get('topology')}") from None
    victim = int(seen["topology"]["plan"][1]["node_id"].removeprefix("host"))
    entry = 0 if victim != 0 else 1  # the text may not depend on the entry either
    before, started = replays(lan, entry), time.monotonic()
    try:
        text, errors = stream(
            lan, entry, body(), lambda n: fault(kind, lan, ring.procs, victim) if n == FAULT_AFTER else None
        )
        seconds = time.monotonic() - started
        assert errors == [] and text == ring.expected
        assert replays(lan, entry) - before >= 1, "the fault came after the answer: nothing was replayed"
        with capsys.disabled():
            print(
                f"\n[multihost] default engine, {kind} of the middle host after {FAULT_AFTER} tokens: answered in "
                f"{seconds:.1f}s, replayed, seeded text identical ({len(text)} chars)"
            )
    finally:
        ring.faulted.add(victim)
