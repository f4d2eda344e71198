"""A secured cluster on a private network: a host without the key (or with another) never gets in, replayed
announcements are dropped, and nothing of a prompt crosses the wire in the clear.

Hosts are network namespaces on a bridge of their own (tests/support/netns.py); traffic never leaves them.
"""

import subprocess
import sys
import time

import numpy as np
import pytest

from node.security import write_key_file
from shards.formats.tokenizer import Tokenizer
from tests.multihost.test_multihost import call, peers_seen, start_hosts, stop_hosts
from tests.support import netns
from tests.support.cluster import ROOT
from tests.support.models import FIXTURES
from tests.support.polling import wait_until

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=netns.available() or "")
MEMBERS = {"host0", "host1", "host2"}

REPLAYER = """
import socket, sys, time
listen = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
listen.bind(("", 5678))
while True:  # a member's announcement, captured from the wire
    data, (ip, _) = listen.recvfrom(4096)
    if ip == sys.argv[1]:
        break
send = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
send.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
for _ in range(5):
    send.sendto(data, (sys.argv[2], 5678))
    time.sleep(0.3)
print("replayed", flush=True)
"""

RAW_CALLS = """
import asyncio, grpc, sys
from node.grpc.generated import node_service_pb2 as pb, node_service_pb2_grpc as pb_grpc
async def go():
    stub = pb_grpc.NodeServiceStub(grpc.aio.insecure_channel(sys.argv[1]))
    for call, msg in [(stub.HealthCheck, pb.HealthCheckRequest()), (stub.SendPrompt, pb.SendPromptRequest()),
                      (lambda m, timeout: stub.SendStream(iter([m]), timeout=timeout).read(), pb.SendRequest()),
                      (stub.EndRequest, pb.EndRequestRequest())]:
        try:
            await call(msg, timeout=3)
            print("OK")
        except grpc.aio.AioRpcError as e:
            print(e.code().name)
asyncio.run(go())
"""


def status(lan, i) -> dict:
    return call(lan, i, "/v1/topology")["nodes"][0]["status"]


def test_a_host_without_the_key_is_never_a_member_and_replayed_announcements_are_dropped(key, tmp_path):
    write_key_file(tmp_path / "other.key")
    with netns.PrivateLan(4, subnet=79) as lan:
        procs = start_hosts(lan, 3, key)
        try:
            replayer = subprocess.Popen(
                lan.exec(3, sys.executable, "-c", REPLAYER, lan.ips[0], "10.231.79.255"),
                stdout=subprocess.PIPE,
                text=True,
            )
            # the rogue: announces itself (signed with another key) and points at the members directly too
            procs += start_hosts(
                lan,
                1,
                tmp_path / "other.key",
                first=3,
                extra=["--peers", ",".join(f"{ip}:50051" for ip in lan.ips[:3])],
            )
            wait_until(
                lambda: all(peers_seen(lan, i) == MEMBERS for i in range(3)),
                30,
                "the members to see each other",
                interval=0.2,
            )
            assert replayer.stdout.readline().strip() == "replayed"
            time.sleep(2)  # more announcements and membership rounds with the rogue around
            assert all(peers_seen(lan, i) == MEMBERS for i in range(3))
            assert peers_seen(lan, 3) == {"host3"}
            seen = [status(lan, i) for i in (1, 2)]
            assert all(s.get("udp_bad_signature", 0) > 0 for s in seen)  # the rogue's own announcements
            assert all(s.get("udp_replayed", 0) > 0 for s in seen)  # host0's announcement, sent again by the rogue
            loaded = {n["node_id"] for n in call(lan, 0, "/v1/topology")["nodes"] if n["loaded"]}
            # greedy: a sampled end-of-text token may end a random fixture's answer early
            body = {
                "model": "llama",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "temperature": 0,
            }
            assert call(lan, 0, "/v1/chat/completions", body)["usage"]["completion_tokens"] == 4
            assert "host3" not in loaded | {n["node_id"] for n in call(lan, 0, "/v1/topology")["nodes"] if n["loaded"]}
            raw = subprocess.run(
                lan.exec(3, sys.executable, "-c", RAW_CALLS, f"{lan.ips[0]}:50051"),
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert raw.stdout.split() == ["UNAVAILABLE"] * 4, raw.stderr
        finally:
            replayer.kill()
            stop_hosts(procs)


def captured_request(lan, key, tmp_path) -> tuple[bytes, bytes]:
    """Bytes crossing the bridge while host0 (the entry, holding the last layers) answers a chat request whose
    prompt goes to host1 (the first layers); and the prompt's token ids as they would be on the wire."""
    content = "The password is swordfish; tell nobody"
    out = tmp_path / "wire.bin"
    shards = {0: "4:6", 1: "0:2", 2: "2:4"}
    procs = []
    try:
        procs = start_hosts(lan, 3, key, per_host={i: ["--shard", s] for i, s in shards.items()})
        wait_until(lambda: peers_seen(lan, 0) == MEMBERS, 30, "host0 to see the members", interval=0.2)
        capture = subprocess.Popen(
            ["ip", "netns", "exec", lan.switch, sys.executable, "-m", "tests.support.capture", "any", "30", str(out)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert capture.stdout.readline().strip() == "capturing"
        body = {"model": "llama", "messages": [{"role": "user", "content": content}], "max_tokens": 8}
        assert call(lan, 0, "/v1/chat/completions", body)["usage"]["completion_tokens"] > 0
        capture.stdin.close()  # the answer is back: every hop of the request has crossed the bridge
        capture.wait(timeout=30)
    finally:
        stop_hosts(procs)
    ids = Tokenizer(FIXTURES / "llama").encode_chat([{"role": "user", "content": content}])
    return out.read_bytes(), np.asarray(ids, np.int64).tobytes()


def test_with_a_key_neither_the_prompt_nor_its_token_ids_cross_the_wire_in_the_clear(key, tmp_path):
    with netns.PrivateLan(3, subnet=80) as lan:
        wire, ids = captured_request(lan, None, tmp_path)
    assert ids in wire  # without a key they do: the capture sees the traffic it should
    with netns.PrivateLan(3, subnet=81) as lan:
        wire, ids = captured_request(lan, key, tmp_path)
    assert len(wire) > 10_000 and ids not in wire and b"swordfish" not in wire
