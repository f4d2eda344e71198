"""Signed discovery packets: HMAC-SHA256 over a timestamp, a random nonce and the announcement.

Packet: MAGIC (8) | timestamp, ms since the Unix epoch, big-endian (8) | nonce (16) | payload | tag (32),
where tag = HMAC-SHA256(key, everything before it). The key is the cluster secret's discovery key (its own HKDF
label), never the secret itself.

Checks, in this order, each with its own counter so an operator can tell what is happening:
1. MAGIC present (else `unsigned`: a node with a key never takes unsigned announcements, or anyone on the LAN
   could point it at their machine);
2. tag valid, compared in constant time (else `bad_signature`): only now is anything in the packet trusted;
3. timestamp within `window` seconds of our clock, either way (else `stale` or `future`): bounds how long a
   captured packet can be replayed, and how long we must remember nonces. Nodes need clocks within ~30 s (NTP);
4. nonce not seen within the window (else `replayed`);
5. timestamp not before this node started (else `stale`): the nonces seen are in memory only, so a node that
   restarts would otherwise take, once, a packet captured in the window before its restart. A peer whose clock
   runs behind ours is heard once its clock passes our start (at most `window` seconds late, at our start only).
The tag is checked before the nonce is remembered, so only holders of the key can fill the replay cache; it is
bounded anyway. Nonces are kept until their packet would be stale, then forgotten.

What a signature does not prove: who sent the packet. The receiver still takes the peer's address from the
packet's source, so someone on the LAN who replays a member's fresh packet before the original arrives could
make us health-check the wrong address; that HealthCheck runs over mutual TLS and fails, so the worst case is a
peer missing until its next announcement, which such an on-path attacker could cause by dropping packets anyway.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Callable

MAGIC = b"exo-sig1"  # never the first bytes of a JSON announcement ('{'), so signed and unsigned can't be confused
NONCE_BYTES = 16
TAG_BYTES = 32
HEADER_BYTES = len(MAGIC) + 8 + NONCE_BYTES
OVERHEAD = HEADER_BYTES + TAG_BYTES
WINDOW_S = 30.0
MAX_REMEMBERED = 65536  # nonces; ~1 per member per interface per second, 60 s kept: room for ~500 members
MIN_KEY_BYTES = 16


class Rejected(ValueError):
    """A packet failed a check; `reason` is the counter to bump (unsigned, bad_signature, stale, future,
    replayed)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def is_signed(packet: bytes) -> bool:
    return packet.startswith(MAGIC)


class PacketAuth:
    """Signs outgoing payloads and opens incoming packets for one discovery key."""

    def __init__(
        self,
        key: bytes,
        window: float = WINDOW_S,
        clock: Callable[[], float] = time.time,
        max_remembered: int = MAX_REMEMBERED,
    ):
        if not isinstance(key, bytes) or len(key) < MIN_KEY_BYTES:
            raise ValueError(f"a discovery key is at least {MIN_KEY_BYTES} bytes")
        self._key, self.window, self.clock, self.max_remembered = key, window, clock, max_remembered
        self.started = clock()  # packets signed before this are refused (check 5): no nonce of theirs is known
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> wall time after which it can be dropped

    def __repr__(self) -> str:
        return f"PacketAuth(window={self.window}, remembered={len(self._seen)})"  # never the key

    def _tag(self, signed_part: bytes) -> bytes:
        return hmac.new(self._key, signed_part, hashlib.sha256).digest()

    def sign(self, payload: bytes) -> bytes:
        """A fresh timestamp and nonce every call: sign each packet sent, even the same payload twice."""
        head = MAGIC + struct.pack(">Q", int(self.clock() * 1000)) + secrets.token_bytes(NONCE_BYTES)
        return head + payload + self._tag(head + payload)

    def open(self, packet: bytes) -> bytes:
        """The payload of a valid, fresh, first-seen packet; raises Rejected otherwise."""
        if not is_signed(packet):
            raise Rejected("unsigned")
        if len(packet) < OVERHEAD:
            raise Rejected("bad_signature")  # a truncated envelope cannot carry a valid tag
        body, tag = packet[:-TAG_BYTES], packet[-TAG_BYTES:]
        if not hmac.compare_digest(self._tag(body), tag):
            raise Rejected("bad_signature")
        (stamp_ms,) = struct.unpack(">Q", body[len(MAGIC) : len(MAGIC) + 8])
        now = self.clock()
        age = now - stamp_ms / 1000
        if age > self.window:
            raise Rejected("stale")
        if age < -self.window:
            raise Rejected("future")
        if stamp_ms < int(self.started * 1000):  # at the stamps' resolution (ms, truncated)
            raise Rejected("stale")  # signed before we started: we can't know whether we saw its nonce
        nonce = body[len(MAGIC) + 8 : HEADER_BYTES]
        self._forget_expired(now)
        if nonce in self._seen:
            raise Rejected("replayed")
        # Keep it until the packet itself would be refused as stale; after that a replay fails check 3.
        self._seen[nonce] = stamp_ms / 1000 + self.window
        while len(self._seen) > self.max_remembered:
            self._seen.popitem(last=False)  # members only (tag checked); oldest first
        return body[HEADER_BYTES:]

    def _forget_expired(self, now: float) -> None:
        # Insertion order is nearly expiry order (stamps are within the window of each other), so stop at the
        # first live entry; a stray expired one further in costs only memory, bounded by max_remembered.
        while self._seen:
            nonce, until = next(iter(self._seen.items()))
            if until >= now:
                break
            del self._seen[nonce]
