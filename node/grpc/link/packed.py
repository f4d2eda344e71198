"""The data link's packed messages: a ring's usual message (activations and sampled tokens, no request spec, no
failure) as fixed-layout bytes in one PACKED frame, instead of the gRPC stream's SendRequest in a DATA frame.

Why: a hop's message is encoded right after a pass and decoded right before one, when the pass has just streamed
the shard's weights through the core's caches; there protobuf's layers (a message object per tensor, entry and
result, then Python objects out of them) cost more than a fixed layout's struct reads and writes, mostly in the
encoding (docs/benchmarks.md, "Packed link messages": a hop's share is small). What is packed means exactly what the SendRequest would: `unpack`
returns what node/grpc/wire.py's `decode_send` returns for the same items, checked by the same functions of wire.py
(every limit and value, with the same errors: `WireError`), so a node accepts the same messages by either path.
Items that carry a spec (a request's first message) or a failure go as a SendRequest (`pack` gives None).

Layout (little-endian): counts of activations and of token messages (u16 each); each activation: its request id
(u16 length, UTF-8), flags (u8: partial, has start), dtype (u8: 0 float32, 1 int64), dims (u8) and the count of
proposals (u16), the start (i64, present or not), the proposals (i64 each), the dims (u32 each), zeros up to an
8-byte boundary, then the tensor's bytes (C order); each token message: its request id, finished (u8), the finish
reason (u8: none, stop, length), the count of results (u16); each result: token (i64), has a logprob (u8), the
logprob (f32), the count of top logprobs (u8), and (token i64, logprob f32) pairs.
"""

from __future__ import annotations

import functools
import math
import struct
import sys

import numpy as np

from node.core.plan import MAX_REQUEST_ID
from node.core.requests import Activation, TokenMessage
from node.grpc.wire import (
    MAX_DIMS,
    MAX_MESSAGES,
    MAX_TOKENS_PER_MESSAGE,
    WireError,
    activation_of,
    result_of,
    tensor_of,
    tokens_of,
)
from shards.decoding.sampling import MAX_TOP_LOGPROBS, SampleResult

_COUNTS = struct.Struct("<HH")
_NAME = struct.Struct("<H")
_ROW = struct.Struct("<BBBH")  # flags, dtype, dims, proposals
_I64 = struct.Struct("<q")
_MESSAGE = struct.Struct("<BBH")  # finished, finish reason, results
_RESULT = struct.Struct("<qBfB")  # token, has logprob, logprob, top logprobs
_TOP = struct.Struct("<qf")
_PARTIAL, _START = 1, 2
_DTYPES = (np.dtype("<f4"), np.dtype("<i8"))
_CODES = {d: i for i, d in enumerate(_DTYPES)}
_REASONS = (None, "stop", "length")
assert MAX_MESSAGES < 1 << 16  # the counts are u16


def pack(activations: tuple[Activation, ...], messages: tuple[TokenMessage, ...]) -> bytes | None:
    """The packed message, or None where an item needs the SendRequest (a spec, a failure, something only wire.py
    can say is wrong: it then says so)."""
    if len(activations) > MAX_MESSAGES or len(messages) > MAX_MESSAGES:
        return None
    out = bytearray(_COUNTS.pack(len(activations), len(messages)))
    try:
        for a in activations:
            if a.spec is not None or not _activation(a, out):
                return None
        for m in messages:
            if m.failure is not None or not _message(m, out):
                return None
    except (struct.error, OverflowError, UnicodeError):  # a value out of the layout's range: wire.py's way
        return None
    return bytes(out)


def _name(request_id: str, out: bytearray) -> None:
    name = request_id.encode()
    out += _NAME.pack(len(name)) + name


def _activation(a: Activation, out: bytearray) -> bool:
    data = a.data
    plain = not (a.partial or a.proposals or a.start is not None) and 1 <= data.ndim <= MAX_DIMS
    if plain and (code := _CODES.get(data.dtype)) is not None:
        out += _plain_head(a.request_id, code, data.shape, len(out) % 8)  # a decode row's: made once per request
        out += data.tobytes(order="C")
        return True
    dtype = next((d for d in _DTYPES if data.dtype.kind == d.kind and data.dtype.itemsize == d.itemsize), None)
    if dtype is None or not 1 <= data.ndim <= MAX_DIMS or len(a.proposals) > MAX_TOKENS_PER_MESSAGE:
        return False
    _name(a.request_id, out)
    flags = (_PARTIAL if a.partial else 0) | (_START if a.start is not None else 0)
    out += _ROW.pack(flags, _DTYPES.index(dtype), data.ndim, len(a.proposals))
    if a.start is not None:
        out += _I64.pack(a.start)
    out += b"".join(_I64.pack(t) for t in a.proposals)
    out += struct.pack(f"<{data.ndim}I", *data.shape)
    out += bytes(-len(out) % 8)  # the tensor 8-aligned in the payload
    out += data.astype(dtype, copy=False).tobytes(order="C")
    return True


@functools.lru_cache(maxsize=1024)
def _plain_head(request_id: str, code: int, shape: tuple[int, ...], at: int) -> bytes:
    """An activation's bytes before its tensor, for one without start, proposals or partial beginning `at` bytes
    past an 8-byte boundary (the padding depends on it): the same bytes `_activation` lays out for it."""
    out = bytearray(at)
    _name(request_id, out)
    out += _ROW.pack(0, code, len(shape), 0) + struct.pack(f"<{len(shape)}I", *shape)
    out += bytes(-len(out) % 8)
    return bytes(out[at:])


def _message(m: TokenMessage, out: bytearray) -> bool:
    if m.finish_reason not in _REASONS or len(m.results) > MAX_TOKENS_PER_MESSAGE:
        return False
    _name(m.request_id, out)
    out += _MESSAGE.pack(m.finished, _REASONS.index(m.finish_reason), len(m.results))
    for r in m.results:
        if len(r.top_logprobs) > MAX_TOP_LOGPROBS:
            return False
        has = r.logprob is not None
        out += _RESULT.pack(r.token, has, r.logprob if has else 0.0, len(r.top_logprobs))
        out += b"".join(_TOP.pack(t, lp) for t, lp in r.top_logprobs)
    return True


def unpack(payload: bytes, max_bytes: int) -> tuple[list[Activation], list[TokenMessage]]:
    """What `wire.decode_send` gives for the message `pack` made `payload` of; WireError for anything else (a
    tensor over `max_bytes`, a value out of range, bytes short or left over)."""
    reader = _Reader(payload)
    n_activations, n_messages = reader.take(_COUNTS)
    if n_activations > MAX_MESSAGES or n_messages > MAX_MESSAGES:
        raise WireError(f"too many items: {n_activations} activations, {n_messages} token messages > {MAX_MESSAGES}")
    activations = [reader.activation(max_bytes) for _ in range(n_activations)]
    messages = [reader.message() for _ in range(n_messages)]
    if reader.at != len(payload):
        raise WireError(f"{len(payload) - reader.at} bytes after the packed message's last item")
    return activations, messages


_FIRST = struct.Struct("<HHH")  # the counts, and the first item's name length
_ONE_ROW = (struct.Struct("<BBBHI"), struct.Struct("<BBBHII"))  # flags, dtype, dims, proposals, then [1] / [1, W]
_LITTLE = sys.byteorder == "little"  # (elsewhere the arrays need converting: `tensor_of`, the usual way)


def unpack_row(payload: bytes, max_bytes: int) -> tuple[str, np.ndarray, list[TokenMessage]] | None:
    """A ring's decode message read the short way: one activation of one row without start, proposals or partial
    (its request id and tensor), then any token messages. None for every other message and for all `unpack`
    refuses: `unpack` then reads it, and judges it. What comes back is what `unpack` gives for the same bytes, a
    view of them as there: it is read right after a pass, on cold caches, as the engine thread waits for it
    (node/runtime/relay.py), where each step of the general reader costs."""
    try:
        n_activations, n_messages, length = _FIRST.unpack_from(payload, 0)
        at = 6 + length
        dims = payload[at + 2]
        if n_activations != 1 or not 1 <= dims <= 2 or not _LITTLE:
            return None
        layout = _ONE_ROW[dims - 1]
        flags, code, _, n_proposals, rows, *width = layout.unpack_from(payload, at)
        request_id = payload[6:at].decode()
    except (struct.error, IndexError, UnicodeDecodeError):
        return None
    if flags or n_proposals or rows != 1 or code >= len(_DTYPES) or width == [0] or n_messages > MAX_MESSAGES:
        return None
    if not 0 < len(request_id) <= MAX_REQUEST_ID:
        return None
    at += layout.size
    at += -at % 8
    dtype, count = _DTYPES[code], width[0] if width else 1
    end = at + count * dtype.itemsize
    if end > len(payload) or end - at > max_bytes:
        return None
    data = np.frombuffer(payload, dtype, count, at).reshape((1, *width))
    if dtype.kind == "f" and not np.isfinite(data).all():
        return None
    messages = []
    if n_messages:
        reader = _Reader(payload)
        reader.at = end
        try:
            messages = [reader.message() for _ in range(n_messages)]
        except WireError:
            return None
        end = reader.at
    return (request_id, data, messages) if end == len(payload) else None


class _Reader:
    """The layout's parsing: wire.py's `activation_of`, `tensor_of`, `result_of` and `tokens_of` check what it
    reads, as they check what a SendRequest holds."""

    def __init__(self, payload: bytes):
        self.payload, self.at = payload, 0

    def take(self, layout: struct.Struct) -> tuple:
        try:
            values = layout.unpack_from(self.payload, self.at)
        except struct.error:
            raise WireError("the packed message ends inside an item") from None
        self.at += layout.size
        return values

    def name(self) -> str:
        (length,) = self.take(_NAME)
        raw = self.payload[self.at : self.at + length]
        self.at += length
        if len(raw) < length:
            raise WireError("the packed message ends inside an item")
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise WireError("request_id is not UTF-8") from None

    def activation(self, max_bytes: int) -> Activation:
        request_id = self.name()
        flags, code, dims, n_proposals = self.take(_ROW)
        if flags & ~(_PARTIAL | _START) or code >= len(_DTYPES) or not 1 <= dims <= MAX_DIMS:
            raise WireError(f"an activation's flags {flags}, dtype {code} or dims {dims} are out of range")
        if n_proposals > MAX_TOKENS_PER_MESSAGE:
            raise WireError(f"too many proposals: {n_proposals} > {MAX_TOKENS_PER_MESSAGE}")
        start = self.take(_I64)[0] if flags & _START else None
        proposals = tuple(self.take(_I64)[0] for _ in range(n_proposals))
        shape = self.take(struct.Struct(f"<{dims}I"))
        self.at += -self.at % 8
        dtype = _DTYPES[code]
        size = math.prod(shape) * dtype.itemsize
        data = memoryview(self.payload)[self.at : self.at + size]
        self.at += size

        def tensor() -> np.ndarray:
            return tensor_of(data, dtype, shape, max_bytes)

        return activation_of(request_id, tensor, None, bool(flags & _PARTIAL), proposals, start)

    def message(self) -> TokenMessage:
        request_id = self.name()
        finished, reason, n_results = self.take(_MESSAGE)
        if finished > 1 or reason >= len(_REASONS) or n_results > MAX_TOKENS_PER_MESSAGE:
            raise WireError(f"a token message's finished {finished}, reason {reason} or count {n_results} is wrong")
        results = tuple(self.result() for _ in range(n_results))
        return tokens_of(request_id, results, bool(finished), _REASONS[reason] or "")

    def result(self) -> SampleResult:
        token, has, logprob, n_top = self.take(_RESULT)
        if has > 1 or n_top > MAX_TOP_LOGPROBS:
            raise WireError(f"a result's logprob flag {has} or top logprobs {n_top} are out of range")
        top = [self.take(_TOP) for _ in range(n_top)]
        return result_of(token, logprob if has else None, top)
