"""The data link's packed messages: whatever a ring's usual message holds, the packed bytes decode to exactly what the
SendRequest of the same items decodes to (wire.py is the reference); items only a SendRequest can carry are left to
it; and bytes that are not a packed message, cut short, with bytes left over or any value out of its range, are a
WireError, never anything else."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.core.failures import Failure, FailureKind
from node.core.plan import PlanStep, RequestSpec
from node.core.requests import Activation, TokenMessage
from node.grpc import wire
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.link.packed import pack, unpack, unpack_row
from shards.decoding.sampling import SampleResult, SamplingParams
from shards.model.shard import Shard

MB = 1 << 20


def by_send_request(activations, messages, max_bytes=MB):
    """The reference: the same items through the gRPC stream's SendRequest."""
    raw = wire.encode_send(tuple(activations), tuple(messages)).SerializeToString()
    return wire.decode_send(pb.SendRequest.FromString(raw), max_bytes)


def fields(a: Activation) -> tuple:
    return a.request_id, a.data.dtype, a.data.shape, a.data.tobytes(), a.spec, a.partial, a.proposals, a.start


names = st.text(min_size=1, max_size=128)
hidden = st.integers(1, 4).flatmap(
    lambda rows: st.lists(
        st.floats(-1e6, 1e6, width=32, allow_subnormal=False), min_size=rows * 3, max_size=rows * 3
    ).map(lambda xs: np.array(xs, np.float32).reshape(rows, 3))
)
tokens = st.lists(st.integers(0, 2**40), min_size=1, max_size=6).map(lambda xs: np.array(xs, np.int64))


@st.composite
def activations(draw) -> Activation:
    data = draw(st.one_of(hidden, tokens))
    if draw(st.booleans()):  # a speculative trip: proposals on the last rows, an explicit start
        proposals = tuple(draw(st.lists(st.integers(0, 2**40), max_size=len(data) - 1)))
        return Activation(draw(names), data, None, False, proposals, draw(st.integers(0, 2**40)))
    start = draw(st.none() | st.integers(0, 2**40))
    return Activation(draw(names), data, None, draw(st.booleans()), (), start)


logprobs = st.floats(max_value=0, width=32, allow_nan=False)
results = st.builds(
    SampleResult,
    st.integers(0, 2**40),
    st.none() | logprobs,
    st.lists(st.tuples(st.integers(0, 2**40), logprobs), max_size=20).map(tuple),
)
messages = st.builds(
    lambda rid, rs, end: TokenMessage(rid, tuple(rs), end is not None, end or None),
    names,
    st.lists(results, max_size=4),
    st.none() | st.sampled_from(["stop", "length"]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(activations(), max_size=4), st.lists(messages, max_size=3))
def test_packed_items_decode_to_what_their_send_request_decodes_to(acts, msgs):
    payload = pack(tuple(acts), tuple(msgs))
    assert payload is not None
    got_acts, got_msgs = unpack(payload, MB)
    ref_acts, ref_msgs = by_send_request(acts, msgs)
    assert [fields(a) for a in got_acts] == [fields(a) for a in ref_acts]
    assert got_msgs == ref_msgs
    for a in got_acts:  # a view of the message's bytes, as wire.py's, and aligned for the engines
        assert not a.data.flags.writeable and a.data.flags.aligned


def test_a_hidden_state_of_another_layout_or_byte_order_packs_as_its_values():
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    for data in (values.T, values.astype(">f4"), values[:, ::2]):
        (got,), _ = unpack(pack((Activation("r", data),), ()), MB)
        assert got.data.dtype == np.float32 and np.array_equal(got.data, data)


def test_a_python_float_logprob_rounds_to_float32_as_on_the_send_request():
    message = TokenMessage("r", (SampleResult(5, -0.7, ((5, -0.7), (6, -2.3))),))
    assert unpack(pack((), (message,)), MB)[1] == by_send_request((), (message,))[1] == [message]


def test_what_only_a_send_request_carries_is_left_to_it():
    spec = RequestSpec("r", (PlanStep("a", "h:1", Shard("m", 0, 4, 4)),), SamplingParams(), 8, frozenset(), "a", "h:1")
    failed = TokenMessage("r", (), True, "error", Failure(FailureKind.LOST, "gone", "n2"))
    hidden_ = np.zeros((1, 3), np.float32)
    assert pack((Activation("r", hidden_, spec),), ()) is None
    assert pack((), (failed,)) is None
    assert pack((Activation("r", hidden_.astype(np.float64)),), ()) is None  # wire.py names the dtype
    assert pack((), (TokenMessage("r", (SampleResult(1, -1e39),)),)) is None  # beyond float32: wire.py's rounding
    assert pack((Activation("r", hidden_),), ()) is not None


def good() -> bytes:
    return pack(
        (Activation("r1", np.ones((2, 3), np.float32), None, False, (9,), 4), Activation("r2", np.array([5]))),
        (TokenMessage("r1", (SampleResult(7, -0.5, ((7, -0.5), (3, -2.0))),), True, "stop"),),
    )


def test_a_message_cut_anywhere_or_with_bytes_left_over_is_refused():
    payload = good()
    for cut in range(len(payload)):
        with pytest.raises(wire.WireError):
            unpack(payload[:cut], MB)
    with pytest.raises(wire.WireError, match="1 bytes after"):
        unpack(payload + b"\0", MB)


def one(rid: bytes = b"r", flags=0, dtype=0, dims=2, proposals=(), start=None, shape=(1, 3), data=None) -> bytes:
    """A packed message of one activation, laid out by hand."""
    out = struct.pack("<HHH", 1, 0, len(rid)) + rid + struct.pack("<BBBH", flags, dtype, dims, len(proposals))
    out += b"".join(struct.pack("<q", v) for v in ([] if start is None else [start]) + list(proposals))
    out += struct.pack(f"<{len(shape)}I", *shape)
    out += bytes(-len(out) % 8)
    return out + (np.ones(shape, np.float32).tobytes() if data is None else data)


def token_message(finished=0, reason=0, results=(), rid=b"r") -> bytes:
    out = struct.pack("<HHH", 0, 1, len(rid)) + rid + struct.pack("<BBH", finished, reason, len(results))
    for token, has, lp, top in results:
        out += struct.pack("<qBfB", token, has, lp, len(top)) + b"".join(struct.pack("<qf", *t) for t in top)
    return out


@pytest.mark.parametrize(
    "payload, match",
    [
        (one(rid=b""), "request_id is missing"),
        (one(rid=b"x" * 129), "longer than 128"),
        (one(rid=b"\xff"), "not UTF-8"),
        (one(flags=4), "flags"),
        (one(dtype=2), "dtype"),
        (one(dims=0, shape=()), "dims"),
        (one(dims=5, shape=(1, 1, 1, 1, 1), data=b"\0" * 8), "dims"),
        (one(flags=2, start=-1), "start"),
        (one(flags=2, start=0, proposals=(-3,)), "proposals"),
        (one(flags=2, start=0, proposals=(1,)), "invalid activation"),  # as many proposals as rows
        (one(proposals=(1,), shape=(2, 3)), "invalid activation"),  # proposals without a start
        (one(data=np.full((1, 3), np.nan, np.float32).tobytes()), "NaN"),
        (one(shape=(1 << 20, 1 << 20), data=b""), "needs 4398046511104 bytes, got 0"),
        (one(shape=(0, 1 << 30), data=b""), "exceeds the limit"),  # empty, but dims no legitimate tensor has
        (struct.pack("<HH", 4097, 0), "too many"),
        (token_message(finished=0, reason=1), "unfinished"),
        (token_message(finished=1, reason=3), "reason"),
        (token_message(finished=2), "finished"),
        (token_message(results=[(-1, 0, 0.0, ())]), "token ids"),
        (token_message(results=[(1, 1, float("nan"), ())]), "logprob"),
        (token_message(results=[(1, 1, float("inf"), ())]), "logprob"),
        (token_message(results=[(1, 0, 0.0, [(2, -1.0)] * 21)]), "top logprobs"),
        (token_message(results=[(1, 0, 0.0, [(-2, -1.0)])]), "token ids"),
    ],
)
def test_a_value_out_of_range_is_refused_naming_it(payload, match):
    with pytest.raises(wire.WireError, match=match):
        unpack(payload, MB)


def test_the_hand_laid_message_is_what_the_refusals_above_mutate():
    (a,), () = unpack(one(flags=2, start=2, proposals=(4,), shape=(2, 3)), MB)
    assert (a.request_id, a.data.shape, a.partial, a.proposals, a.start) == ("r", (2, 3), False, (4,), 2)
    (a,), () = unpack(one(flags=1), MB)
    assert (a.partial, a.start) == (True, None)
    (), (m,) = unpack(token_message(1, 2, [(3, 1, -0.5, [(3, -0.5)])]), MB)
    assert m == TokenMessage("r", (SampleResult(3, -0.5, ((3, -0.5),)),), True, "length")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_are_refused_only_as_wire_errors(payload):
    try:
        unpack(payload, MB)
    except wire.WireError:
        pass


def test_mutated_messages_are_refused_only_as_wire_errors_or_decode_as_checked_values():
    valid, rng, decoded = good(), random.Random(99), 0
    for _ in range(500):
        raw = bytearray(valid)
        for _ in range(rng.randrange(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        try:
            acts, msgs = unpack(bytes(raw), MB)
        except wire.WireError:
            continue
        decoded += 1  # what got through is what a SendRequest of it gives: the checks are the same
        ref_acts, ref_msgs = by_send_request(acts, msgs)
        assert [fields(a) for a in acts] == [fields(a) for a in ref_acts] and msgs == ref_msgs
    assert decoded > 20  # (most mutations hit a tensor's bytes or a logprob and still decode)


def short_way(payload: bytes) -> tuple | None:
    """What `unpack_row` read, in `unpack`'s terms (None: it left the message to `unpack`)."""
    got = unpack_row(payload, MB)
    return None if got is None else ([fields(Activation(got[0], got[1]))], got[2])


def long_way(payload: bytes) -> tuple:
    acts, msgs = unpack(payload, MB)
    return [fields(a) for a in acts], msgs


@settings(max_examples=200, deadline=None)
@given(st.lists(activations(), max_size=2), st.lists(messages, max_size=2))
def test_the_short_way_reads_what_unpack_reads_or_leaves_the_message_to_it(acts, msgs):
    payload = pack(tuple(acts), tuple(msgs))
    if (got := short_way(payload)) is not None:
        assert got == long_way(payload)
    a = acts[0] if len(acts) == 1 else None
    one_row = a is not None and len(a.data) == 1 and a.data.ndim <= 2
    if one_row and not (a.partial or a.proposals or a.start is not None):  # a decode step's usual message
        assert got is not None


def test_a_decode_rows_message_is_read_the_short_way_with_its_tokens():
    hidden_row = np.linspace(-1, 1, 6, dtype=np.float32).reshape(1, 6)
    token = TokenMessage("r", (SampleResult(7, -0.5, ((7, -0.5),)),))
    for acts, msgs in (((Activation("r", hidden_row),), ()), ((Activation("r", np.array([7])),), (token,))):
        rid, data, got = unpack_row(pack(acts, msgs), MB)
        assert (rid, data.tobytes(), got) == ("r", acts[0].data.tobytes(), list(msgs))
        assert not data.flags.writeable  # a view of the message, as unpack's
    for other in (  # a prompt chunk, a speculative trip, two rows, two activations: unpack's
        (Activation("r", hidden_row, partial=True),),
        (Activation("r", np.array([1, 2]), proposals=(2,), start=3),),
        (Activation("r", np.ones((2, 6), np.float32)),),
        (Activation("r", hidden_row), Activation("s", hidden_row)),
    ):
        assert unpack_row(pack(other, ()), MB) is None


def test_the_short_way_refuses_nothing_and_takes_nothing_unpack_refuses():
    valid, rng, read = (
        pack((Activation("r1", np.ones((1, 5), np.float32)),), (TokenMessage("r1", (SampleResult(3, -0.25),)),)),
        random.Random(7),
        0,
    )
    for cut in range(len(valid)):
        assert unpack_row(valid[:cut], MB) is None
    assert unpack_row(valid + b"\0", MB) is None
    assert unpack_row(one(data=np.full((1, 3), np.inf, np.float32).tobytes()), MB) is None
    for _ in range(1000):
        raw = bytearray(valid)
        for _ in range(rng.randrange(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        if (got := short_way(bytes(raw))) is not None:
            read += 1
            assert got == long_way(bytes(raw))  # (raises where unpack refuses what the short way took)
    assert read > 100


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_read_the_short_way_are_what_unpack_reads(payload):
    if (got := short_way(payload)) is not None:
        assert got == long_way(payload)
