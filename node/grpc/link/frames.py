"""The data link's bytes: a greeting each way, then frames of a 5-byte header (payload length, little-endian u32;
kind, u8) and the payload. DATA carries one data-path message (the gRPC stream's SendRequest, answered by a
SendResponse: node/grpc/wire.py encodes both), PACKED the same message in a fixed layout (node/grpc/link/packed.py,
answered as DATA is), ERROR the reason a peer refused the last message before it closes. The greeting names the
version: a peer of another version gets no link, and its messages go on the gRPC stream.

The reader is incremental (bytes arrive in any pieces) and refuses, before buffering it, a frame longer than the
bound the model implies (node/grpc/client.py: message_bound), as gRPC does a message: what a peer makes a node hold
is bounded by the model, not by what the peer claims.
"""

from __future__ import annotations

import struct

VERSION = 2  # 2: PACKED
GREETING = b"EXO-LINK" + struct.pack("<H", VERSION)  # both ends say it first: a stray client never gets a frame
HEADER = struct.Struct("<IB")
DATA, ERROR, PACKED = 0, 1, 2
KINDS = (DATA, ERROR, PACKED)


class FrameError(ValueError):
    """The bytes are not frames of this protocol (the connection is closed: nothing after them can be trusted)."""


def frame(kind: int, payload: bytes) -> bytes:
    if kind not in KINDS:
        raise ValueError(f"frame kind must be one of {KINDS}, got {kind!r}")
    return HEADER.pack(len(payload), kind) + payload


class FrameReader:
    """Frames out of a byte stream fed in pieces: `feed` returns the (kind, payload) pairs the bytes so far
    complete, in order, and keeps the rest; a FrameError for a frame over `max_payload` or of an unknown kind
    (decided from its header alone)."""

    def __init__(self, max_payload: int):
        if max_payload < 0:
            raise ValueError(f"a frame's bound is never negative, got {max_payload}")
        self.max_payload = max_payload
        self.buffer = bytearray()

    @property
    def pending(self) -> int:
        """Bytes held of a frame not yet complete."""
        return len(self.buffer)

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self.buffer += data
        out, at = [], 0
        while len(self.buffer) - at >= HEADER.size:
            length, kind = HEADER.unpack_from(self.buffer, at)
            if kind not in KINDS:
                raise FrameError(f"unknown frame kind {kind}")
            if length > self.max_payload:
                raise FrameError(f"a frame of {length} bytes, over the bound of {self.max_payload}")
            end = at + HEADER.size + length
            if end > len(self.buffer):
                break
            out.append((kind, bytes(self.buffer[at + HEADER.size : end])))
            at = end
        del self.buffer[:at]
        return out
