"""Signed discovery: with a cluster key only fresh, first-seen announcements signed with that key get through;
everything else is dropped and counted, and no packet, however broken, stops the listener."""

import asyncio
import logging
import random
import time

import pytest

from discovery.signed import MAGIC, OVERHEAD, PacketAuth, Rejected
from discovery.udp import MAX_PACKET, Announcement, UdpDiscovery
from node.security import ClusterKey, generate_secret
from tests.support.factories import free_udp_port
from tests.support.polling import holds_within

KEY = ClusterKey(generate_secret()).discovery_key()
OTHER_KEY = ClusterKey(generate_secret()).discovery_key()
PEER = Announcement("node-b", 50051, "llama", "numpy", 8 << 30)
SRC = ("10.0.0.7", 5678)
DROPS = ("udp_unsigned", "udp_bad_signature", "udp_stale", "udp_future", "udp_replayed", "udp_invalid")


def listener(key=KEY) -> UdpDiscovery:
    return UdpDiscovery(lambda: Announcement("me", 1, "llama", "numpy", 0), key=key)


def signed(payload: bytes = PEER.encode(), key: bytes = KEY, skew: float = 0.0) -> bytes:
    return PacketAuth(key, clock=lambda: time.time() + skew).sign(payload)


def drops(d: UdpDiscovery) -> dict[str, int]:
    return {k: d.stats[k] for k in DROPS if d.stats[k]}


def test_an_announcement_signed_with_our_key_is_accepted():
    d = listener()
    d.received(signed(), SRC)
    assert d.candidates() == ["10.0.0.7:50051"] and d.stats["udp_received"] == 1 and drops(d) == {}


# Factories, not packets: a packet made at collection time would age while other tests run.
@pytest.mark.parametrize(
    "make,counter",
    [
        (lambda: PEER.encode(), "udp_unsigned"),  # today's plain announcement
        (lambda: signed(key=OTHER_KEY), "udp_bad_signature"),  # another cluster
        (lambda: signed(skew=-31), "udp_stale"),
        (lambda: signed(skew=+31), "udp_future"),
        (lambda: signed()[:-1], "udp_bad_signature"),  # tag truncated
        (lambda: signed()[: OVERHEAD - 1], "udp_bad_signature"),  # envelope too short to hold a tag
        (lambda: MAGIC, "udp_bad_signature"),
        (lambda: signed() + b"x" * (MAX_PACKET + 1), "udp_invalid"),  # oversized: dropped before any work
    ],
    ids=["unsigned", "other-key", "stale", "future", "truncated-tag", "short-envelope", "magic-only", "oversized"],
)
def test_a_node_with_a_key_drops_and_counts_everything_else(make, counter):
    d = listener()
    d.received(make(), SRC)
    assert d.candidates() == [] and drops(d) == {counter: 1}


def test_changing_any_byte_of_a_signed_packet_breaks_its_signature():
    good = signed()
    for i in range(len(good)):
        d = listener()
        tampered = bytearray(good)
        tampered[i] ^= 0x01
        d.received(bytes(tampered), SRC)
        expected = "udp_unsigned" if i < len(MAGIC) else "udp_bad_signature"
        assert drops(d) == {expected: 1}, i


def test_a_packet_just_inside_the_window_either_way_is_accepted():
    d = listener()
    d.auth.started -= 60  # a listener up for a minute (one just started takes nothing signed before it started)
    d.received(signed(skew=-29), SRC)
    d.received(signed(Announcement("node-c", 50052, "llama", "numpy", 1).encode(), skew=+29), ("10.0.0.8", 5678))
    assert sorted(d.candidates()) == ["10.0.0.7:50051", "10.0.0.8:50052"] and drops(d) == {}


def test_a_replayed_packet_is_dropped_even_from_another_address():
    d = listener()
    packet = signed()
    d.received(packet, SRC)
    d.received(packet, ("10.0.0.66", 5678))  # someone on the LAN re-sends what they captured
    assert d.candidates() == ["10.0.0.7:50051"] and drops(d) == {"udp_replayed": 1}
    d.received(signed(), SRC)  # the peer's next announcement: a fresh nonce
    assert d.stats["udp_received"] == 2


def test_nonces_are_forgotten_once_their_packet_would_be_stale_anyway():
    now = [1_700_000_000.0]
    auth = PacketAuth(KEY, clock=lambda: now[0])
    packets = [auth.sign(b"p%d" % i) for i in range(100)]
    for p in packets:
        auth.open(p)
    with pytest.raises(Rejected, match="replayed"):
        auth.open(packets[0])
    now[0] += 31
    auth.open(auth.sign(b"later"))
    assert len(auth._seen) == 1  # the 100 old nonces are gone ...
    with pytest.raises(Rejected, match="stale"):  # ... and their packets are refused by age instead
        auth.open(packets[0])


def test_the_replay_memory_is_bounded():
    auth = PacketAuth(KEY, max_remembered=50)
    for i in range(200):
        auth.open(auth.sign(b"%d" % i))
    assert len(auth._seen) == 50


def test_our_own_signed_packets_are_recognised_as_ours():
    d = UdpDiscovery(lambda: PEER, key=KEY)
    d.received(signed(), SRC)
    assert d.stats["udp_self"] == 1 and d.candidates() == []


def test_a_node_without_a_key_ignores_signed_packets_says_so_once_and_still_takes_plain_ones(caplog):
    d = listener(key=None)
    with caplog.at_level(logging.WARNING, logger="discovery.udp"):
        d.received(signed(), SRC)
        d.received(signed(), SRC)
    assert d.stats["udp_signed_ignored"] == 2 and d.candidates() == []
    assert caplog.text.count("no cluster key") == 1 and "--cluster-key-file" in caplog.text
    d.received(PEER.encode(), SRC)
    assert d.candidates() == ["10.0.0.7:50051"]


@pytest.mark.parametrize("key", [b"", b"short", "a-str-key-of-32-characters......"])
def test_a_discovery_key_must_be_bytes_of_at_least_16(key):
    with pytest.raises(ValueError):
        UdpDiscovery(lambda: PEER, key=key)


def test_the_key_never_shows_in_a_repr():
    assert KEY.hex() not in repr(PacketAuth(KEY)) and repr(KEY) not in repr(PacketAuth(KEY))


def test_fuzzed_packets_never_crash_a_keyed_listener_and_each_is_counted_once():
    d = listener()
    rng = random.Random(11)
    good = signed()
    for i in range(3000):
        kind = i % 3
        if kind == 0:
            packet = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 1500)))
        elif kind == 1:  # random bytes behind our magic: looks signed, is not
            packet = MAGIC + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))
        else:  # a valid packet with a few bytes changed or cut
            b = bytearray(good)
            for _ in range(rng.randrange(1, 4)):
                b[rng.randrange(len(MAGIC), len(b))] = rng.randrange(256)
            packet = bytes(b[: rng.randrange(len(MAGIC), len(b) + 1)])
        d.received(packet, SRC)
    assert sum(drops(d).values()) == 3000 and d.stats["udp_received"] == 0 and d.candidates() == []
    assert d.stats["udp_bad_signature"] >= 2000 - 5


async def find_each_other(a: UdpDiscovery, b: UdpDiscovery, seconds: float) -> None:
    await a.start()
    await b.start()
    try:
        await holds_within(lambda: a.candidates() and b.candidates(), seconds)  # not finding them is an outcome
    finally:
        await a.stop()
        await b.stop()


def pair(key_a, key_b) -> tuple[UdpDiscovery, UdpDiscovery]:
    port = free_udp_port()
    a = UdpDiscovery(lambda: Announcement("a", 1001, "m", "numpy", 1), port, 0.05, interfaces=["lo"], key=key_a)
    b = UdpDiscovery(lambda: Announcement("b", 1002, "m", "numpy", 1), port, 0.05, interfaces=["lo"], key=key_b)
    return a, b


def test_two_nodes_with_the_same_key_find_each_other_over_loopback():
    a, b = pair(KEY, KEY)
    asyncio.run(find_each_other(a, b, 10))
    assert a.candidates() == ["127.0.0.1:1002"] and b.candidates() == ["127.0.0.1:1001"]
    assert a.stats["udp_self"] > 0 and drops(a) == {} and drops(b) == {}


def test_nodes_with_different_keys_or_no_key_never_see_each_other():
    a, b = pair(KEY, OTHER_KEY)
    asyncio.run(find_each_other(a, b, 0.5))
    assert a.candidates() == b.candidates() == []
    assert a.stats["udp_bad_signature"] > 0 and b.stats["udp_bad_signature"] > 0
    keyed, plain = pair(KEY, None)
    asyncio.run(find_each_other(keyed, plain, 0.5))
    assert keyed.candidates() == plain.candidates() == []
    assert keyed.stats["udp_unsigned"] > 0 and plain.stats["udp_signed_ignored"] > 0


def test_a_restarted_node_takes_no_packet_signed_before_it_started():
    """Its nonces were in memory: a packet captured just before the restart is refused by age, not by nonce."""
    now = [1_700_000_000.0]
    sender = PacketAuth(KEY, clock=lambda: now[0])
    before = sender.sign(b"announcement")
    first_life = PacketAuth(KEY, clock=lambda: now[0])
    first_life.open(before)
    now[0] += 5
    restarted = PacketAuth(KEY, clock=lambda: now[0])
    with pytest.raises(Rejected, match="stale"):
        restarted.open(before)  # replayed 5 s later, well inside the window
    after = sender.sign(b"announcement")
    assert restarted.open(after) == b"announcement"
    with pytest.raises(Rejected, match="replayed"):
        restarted.open(after)
