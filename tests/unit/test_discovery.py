"""Discovery: UDP announcement validation, eviction, two instances on one host, and the manual peers file."""

import asyncio
import itertools
import json
import os
import random
import time

import pytest

from discovery.manual import ManualConfigError, ManualDiscovery
from discovery.static import PeerListError, parse_peers
from discovery.udp import MAX_PACKET, Announcement, BadPacket, UdpDiscovery, parse_announcement
from tests.support.factories import free_udp_port
from tests.support.polling import wait_until_async

GOOD = Announcement("node-a", 50051, "llama", "numpy", 8 << 30)


def mutate(**over) -> bytes:
    obj = json.loads(GOOD.encode()) | over
    return json.dumps({k: v for k, v in obj.items() if v is not ...}).encode()


def test_announcements_round_trip():
    assert parse_announcement(GOOD.encode()) == GOOD


@pytest.mark.parametrize(
    "packet",
    [
        b"",
        b"{",
        b"[]",
        b"null",
        b"\xff\xfe",
        b"[" * 5000 + b"]" * 5000,
        b'{"app": "exo-node"}',
        mutate(app="other"),
        mutate(v=2),
        mutate(v="1"),
        mutate(v=...),
        mutate(node_id=""),
        mutate(node_id="a b"),
        mutate(node_id="x" * 65),
        mutate(node_id=5),
        mutate(grpc_port=0),
        mutate(grpc_port=70000),
        mutate(grpc_port="50051"),
        mutate(grpc_port=True),
        mutate(model_id=None),
        mutate(model_id="m" * 300),
        mutate(engine=["numpy"]),
        mutate(memory_bytes=-1),
        mutate(memory_bytes=1.5),
        mutate(memory_bytes=...),
        mutate(node_id="a" * 64, model_id="m" * 256, pad="x" * MAX_PACKET),
    ],
)
def test_malformed_packets_are_rejected(packet):
    with pytest.raises(BadPacket):
        parse_announcement(packet)


def test_fuzzed_packets_never_crash_the_listener_and_are_counted():
    d = UdpDiscovery(lambda: Announcement("me", 1, "m", "numpy", 0))
    rng = random.Random(7)
    base = GOOD.encode()
    for i in range(2000):
        if i % 2:
            packet = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 1500)))
        else:  # flip bytes of a valid packet: mostly broken JSON, sometimes valid JSON with bad fields
            b = bytearray(base)
            for _ in range(rng.randrange(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(32, 127)
            packet = bytes(b)
        d.received(packet, ("192.0.2.1", 5678))
    assert d.stats["udp_invalid"] + d.stats["udp_received"] == 2000
    assert d.stats["udp_invalid"] > 1900
    assert all(addr.endswith(tuple(f":{p}" for p in range(1, 65536))) for addr in d.candidates())


def test_own_packets_are_ignored():
    d = UdpDiscovery(lambda: GOOD)
    d.received(GOOD.encode(), ("10.0.0.1", 5678))
    assert d.stats["udp_self"] == 1 and d.candidates() == []


def test_a_peer_not_heard_from_for_the_timeout_is_dropped():
    d = UdpDiscovery(lambda: Announcement("me", 1, "m", "numpy", 0), timeout=0.2)
    d.received(GOOD.encode(), ("10.0.0.7", 5678))
    assert d.candidates() == ["10.0.0.7:50051"]  # address: the packet's source, port: the announced one
    time.sleep(0.3)
    assert d.candidates() == []


def test_two_instances_on_one_host_find_each_other_over_loopback():
    async def go():
        port = free_udp_port()
        a = UdpDiscovery(lambda: Announcement("a", 1001, "m", "numpy", 1), port, interval=0.05, interfaces=["lo"])
        b = UdpDiscovery(lambda: Announcement("b", 1002, "m", "numpy", 1), port, interval=0.05, interfaces=["lo"])
        await a.start()
        await b.start()  # the same port twice on one host: address/port reuse
        try:
            await wait_until_async(lambda: a.candidates() and b.candidates(), 10, "the two nodes to hear each other")
            assert a.candidates() == ["127.0.0.1:1002"] and b.candidates() == ["127.0.0.1:1001"]
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(go())


_EDITS = itertools.count(1)


def write(path, obj):
    path.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
    stamp = (1_700_000_000 + next(_EDITS)) * 10**9  # every edit gets a distinct mtime, however fast the test
    os.utime(path, ns=(stamp, stamp))


def test_manual_file_is_reread_when_it_changes_and_bad_edits_keep_the_last_good_list(tmp_path):
    f = tmp_path / "peers.json"
    write(f, {"peers": [{"id": "b", "address": "192.0.2.11", "port": 50051}]})
    d = ManualDiscovery(f)
    assert d.candidates() == ["192.0.2.11:50051"]
    write(
        f,
        {
            "peers": [
                {"id": "b", "address": "192.0.2.11", "port": 50051},
                {"id": "c", "address": "192.0.2.12", "port": 50052, "capabilities": {"engine": "mlx"}},
            ]
        },
    )
    assert d.candidates() == ["192.0.2.11:50051", "192.0.2.12:50052"]
    write(f, "{ broken")
    assert d.candidates() == ["192.0.2.11:50051", "192.0.2.12:50052"]
    write(f, {"peers": []})
    assert d.candidates() == [] and d.reloads == 2


@pytest.mark.parametrize(
    "content,message",
    [
        ("nope", "not valid JSON"),
        ({"peer": []}, "expected"),
        ({"peers": [5]}, r"peers\[0\] must be an object"),
        ({"peers": [{"address": "h", "port": 1}]}, r"peers\[0\]\.id"),
        ({"peers": [{"id": "a", "address": "h h", "port": 1}]}, r"peers\[0\]\.address"),
        ({"peers": [{"id": "a", "address": "h", "port": 0}]}, r"peers\[0\]\.port"),
        ({"peers": [{"id": "a", "address": "h", "port": 1, "capabilities": []}]}, "capabilities"),
    ],
)
def test_bad_manual_file_at_startup_is_a_clear_error(tmp_path, content, message):
    f = tmp_path / "peers.json"
    write(f, content)
    with pytest.raises(ManualConfigError, match=message):
        ManualDiscovery(f)
    with pytest.raises(ManualConfigError, match="cannot read"):
        ManualDiscovery(tmp_path / "missing.json")


def test_static_peer_lists():
    assert parse_peers(" a:1, b:2 ,,") == ["a:1", "b:2"]
    for bad in ("a", "a:", ":1", "a:0", "a:65536", "a:x", "a:1²"):
        with pytest.raises(PeerListError):
            parse_peers(bad)
