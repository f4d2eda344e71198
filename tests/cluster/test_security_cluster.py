"""A cluster only its members can use, on live nodes over loopback.

Each attack below worked against exo-node before the cluster key existed (see the issue): a crafted plan made a
node compute for, or send activations to, a stranger; crafted prompts whose next hop never answers filled every
request slot; anyone could end anyone's request. Now: with a key, a caller without it can't complete a single RPC;
without a key, a node still only follows plans among the members it knows.
"""

import asyncio
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from node.core.plan import PlanStep, RequestSpec
from node.grpc import wire
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.generated import node_service_pb2_grpc as pb_grpc
from node.grpc.link.frames import DATA, GREETING, frame
from node.security import write_key_file
from shards.decoding.sampling import SamplingParams
from shards.model.shard import Shard
from tests.support.cluster import ROOT, Cluster, assert_matches_reference, free_port
from tests.support.models import FIXTURES

MODEL = FIXTURES / "llama"
REFUSED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)


class Collector(pb_grpc.NodeServiceServicer):
    """The attacker's own gRPC server: records whatever a victim node sends it."""

    def __init__(self):
        self.received = []

    async def SendStream(self, requests, context):  # the data path a node sends activations and tokens on
        async for request in requests:
            self.received.append(request)
            yield pb.SendResponse()


def crafted(rid: str, victim: str, attacker: str, attacker_is_entry: bool) -> pb.SendPromptRequest:
    """A prompt whose plan sends the victim's work to the attacker: as the entry (free compute, forged answers)
    or as the next hop (activations leak)."""
    if attacker_is_entry:
        plan = (PlanStep("node0", victim, Shard("llama", 0, 6, 6)),)
        entry = ("mallory", attacker)
    else:
        plan = (
            PlanStep("node0", victim, Shard("llama", 0, 3, 6)),
            PlanStep("mallory", attacker, Shard("llama", 3, 6, 6)),
        )
        entry = ("node0", victim)
    spec = RequestSpec(rid, plan, SamplingParams(temperature=0), 24, frozenset(), *entry, prompt_tokens=3)
    return pb.SendPromptRequest(spec=wire.encode_spec(spec), tokens=wire.encode_tensor(np.array([1, 2, 3])))


def attack(victim: str, n: int = 1, credentials=None, attacker_is_entry=True):
    """Send n crafted prompts to `victim` from a stranger; returns (status codes, what the stranger received)."""

    async def go():
        server = grpc.aio.server()
        collector = Collector()
        pb_grpc.add_NodeServiceServicer_to_server(collector, server)
        attacker = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        channel = grpc.aio.secure_channel(victim, credentials) if credentials else grpc.aio.insecure_channel(victim)
        stub = pb_grpc.NodeServiceStub(channel)
        codes = []
        for i in range(n):
            try:
                await stub.SendPrompt(crafted(f"evil{i}", victim, attacker, attacker_is_entry), timeout=3)
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as e:
                codes.append(e.code())
        await asyncio.sleep(1.0)  # time for anything the victim would send
        await channel.close()
        await server.stop(None)
        return codes, collector.received

    return asyncio.run(go())


def other_calls(victim: str) -> list[grpc.StatusCode]:
    """Every other RPC, as a stranger without the key."""

    async def go():
        channel = grpc.aio.insecure_channel(victim)
        stub = pb_grpc.NodeServiceStub(channel)
        calls = [
            stub.SendStream(iter([pb.SendRequest()]), timeout=3).read(),
            stub.EndRequest(pb.EndRequestRequest(request_id="x"), timeout=3),
            stub.HealthCheck(pb.HealthCheckRequest(), timeout=3),
            stub.Leave(pb.LeaveRequest(node_id="n"), timeout=3),
            stub.GetManifest(pb.ManifestRequest(model_id="llama"), timeout=3),  # the weights, too
            stub.FetchPiece(pb.PieceRequest(model_id="llama", piece=0), timeout=3).read(),
        ]
        codes = []
        for c in calls:
            try:
                await c
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as e:
                codes.append(e.code())
        await channel.close()
        return codes

    return asyncio.run(go())


def victim_address(c: Cluster) -> str:
    return f"127.0.0.1:{c.ports[0]}"


def steps(c: Cluster) -> int:
    return c.self_info()["node0"]["status"].get("steps", 0)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "cluster.key"
    write_key_file(path)
    return path


@pytest.fixture(scope="module")
def keyed(key_file):
    """Three nodes holding the key, layers pinned 0:2 / 2:4 / 4:6: the members, and the victims of the attacks."""
    with Cluster(MODEL, 3, shards=["0:2", "2:4", "4:6"], per_node=[["--cluster-key-file", str(key_file)]] * 3) as c:
        yield c


def test_a_keyed_cluster_serves_exactly_and_nodes_without_the_key_stay_out(keyed, tmp_path):
    c = keyed
    assert_matches_reference(c, "The capital of France is", 16)
    write_key_file(tmp_path / "other.key")
    peers = ",".join(f"127.0.0.1:{p}" for p in c.ports)
    # both strangers at once, one with another key and one with none: each a lone node0 of its own
    with (
        Cluster(MODEL, 1, per_node=[["--cluster-key-file", str(tmp_path / "other.key"), "--peers", peers]]) as d,
        Cluster(MODEL, 1, per_node=[["--peers", peers]]) as e,
    ):
        time.sleep(3)  # several membership rounds, both ways
        for stranger in (d, e):
            assert [n["node_id"] for n in stranger.topology()["nodes"]] == ["node0"]
        assert len(c.topology()["nodes"]) == 3
    assert_matches_reference(c, "Hello there, how are you?", 16)


def test_a_keyed_clusters_data_path_goes_on_mutual_tls_links_a_stranger_cannot_speak_to(keyed):
    """The data links (node/grpc/link/) with a key: mutual TLS as gRPC's, each message taken as its sender's
    (the plans' checks pass), the decode rows' messages written by the engine threads as their passes end (the
    link's client seals them itself: node/grpc/link/tls_session.py), and a stranger at the link's port gets not one
    byte of the protocol."""
    c = keyed
    deadline = time.monotonic() + 15  # the links come up in the background, a health check after the start
    counted = lambda: {  # noqa: E731
        n: (i["status"].get("link_messages", 0), i["status"].get("written_rows", 0)) for n, i in c.self_info().items()
    }
    while True:
        before = counted()
        assert_matches_reference(c, "Why?", 12)
        after = counted()
        if all(after[n][0] > before[n][0] for n in after) or time.monotonic() > deadline:
            break
    assert {n: after[n][0] > before[n][0] for n in after} == dict.fromkeys(after, True)
    assert {n: after[n][1] > before[n][1] for n in after} == dict.fromkeys(after, True)
    link_port = c.self_info()["node0"]["link_port"]
    done = steps(c)
    with socket.create_connection(("127.0.0.1", link_port), timeout=5) as plain:
        plain.sendall(GREETING + frame(DATA, b"\x0a\x03abc"))  # the protocol in plaintext, not a TLS handshake
        plain.settimeout(5)
        assert GREETING not in plain.recv(1 << 16)  # closed (a TLS alert at most), never the protocol's greeting
    assert steps(c) == done and c.active_requests()["node0"] == 0


def test_without_the_key_no_rpc_completes_and_no_work_is_done(keyed):
    c = keyed  # (whatever it served before: the attacks below must add no step and hold no request)
    before = steps(c)
    for attacker_is_entry in (True, False):  # free compute / forged answers, then the activation leak
        codes, received = attack(victim_address(c), attacker_is_entry=attacker_is_entry)
        assert codes[0] in REFUSED and received == []
    assert set(other_calls(victim_address(c))) <= set(REFUSED)
    with_tls = grpc.ssl_channel_credentials()  # TLS, but trusting only the public roots and with no client cert
    assert attack(victim_address(c), credentials=with_tls)[0][0] in REFUSED
    assert steps(c) == before and c.active_requests()["node0"] == 0


def test_without_a_key_a_node_still_only_follows_plans_among_its_members():
    with Cluster(MODEL, 1) as c:
        for attacker_is_entry in (True, False):
            codes, received = attack(victim_address(c), attacker_is_entry=attacker_is_entry)
            assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] and received == []  # "not a member"
        # 300 crafted prompts (the slots are 256) take no slot: a real user is served at once
        codes, _ = attack(victim_address(c), n=300, attacker_is_entry=False)
        assert set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        status, body = c.chat("Hello", max_tokens=4, temperature=0)
        assert status == 200, body
        assert steps(c) == 4 and c.wait_idle()["node0"] == 0


def test_without_a_key_grpc_listens_on_loopback_only_and_says_why():
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "node.cli",
            "--model",
            str(MODEL),
            "--grpc-port",
            str(port),
            "--no-api",
            "--discovery",
            "none",
            "--log-level",
            "info",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "gRPC listening" in line:
                break
        log = "".join(lines)
        assert f"gRPC listening on 127.0.0.1:{port}" in log
        assert "no cluster key" in log and "exo-node keygen" in log
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_keygen_writes_a_private_key_file_and_never_overwrites_one(tmp_path):
    out = tmp_path / "k"
    run = [sys.executable, "-m", "node.cli", "keygen", "--out", str(out)]
    first = subprocess.run(run, cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0 and "fingerprint" in first.stdout and out.stat().st_mode & 0o077 == 0
    again = subprocess.run(run, cwd=ROOT, capture_output=True, text=True)
    assert again.returncode != 0 and "exists" in again.stderr
    assert out.read_text().strip() not in first.stdout + first.stderr  # the secret itself is never printed
