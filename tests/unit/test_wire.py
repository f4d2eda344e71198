"""The wire format: every value survives a round trip, and anything malformed from the network is a WireError.
Shard ranges, sampling parameters and request specs: test_wire_spec.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from node.core.failures import Failure, FailureKind
from node.core.plan import PlanStep, RequestSpec
from node.core.requests import Activation, TokenMessage
from node.core.topology import Capabilities, NodeInfo
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.wire import (
    WireError,
    decode_activation,
    decode_result,
    decode_spec,
    decode_tensor,
    decode_tokens,
    encode_activation,
    encode_result,
    encode_tensor,
    encode_tokens,
)
from node.grpc.wire_cluster import decode_node_info, encode_node_info
from shards.decoding.sampling import SampleResult, SamplingParams
from shards.model.shard import Shard
from tests.unit.test_wire_spec import spec_msg

MB = 1 << 20


def tensor(data: bytes = b"", shape=(0,), dtype: str = "float32") -> pb.Tensor:
    return pb.Tensor(data=data, shape=list(shape), dtype=dtype)


def make_node(**overrides) -> NodeInfo:
    fields = dict(
        node_id="n1",
        address="host.local:5000",
        capabilities=Capabilities(memory_bytes=64 << 30, engine="numpy", model_id="m", n_layers=16),
        pinned=(0, 8),
        loaded=(Shard("m", 0, 8, 16), Shard("m", 8, 16, 16)),
        active_requests=3,
        status={"requests_total": 12, "rejected": 0},
        link_port=50123,
    )
    return NodeInfo(**{**fields, **overrides})


# --- tensors ---------------------------------------------------------------------------------------------


def test_int64_tokens_round_trip():
    a = np.array([1, 151643, 0, 2**40], dtype=np.int64)
    t = encode_tensor(a)
    assert (t.dtype, list(t.shape)) == ("int64", [4])
    b = decode_tensor(t, MB)
    assert b.dtype == np.int64 and b.dtype.isnative
    np.testing.assert_array_equal(a, b)


def test_float32_hidden_round_trip():
    a = np.random.default_rng(0).standard_normal((3, 64), dtype=np.float32)
    b = decode_tensor(encode_tensor(a), MB)
    assert b.dtype == np.float32 and b.shape == (3, 64)
    np.testing.assert_array_equal(a, b)


def test_non_contiguous_input_is_sent_in_c_order():
    a = np.arange(12, dtype=np.float32).reshape(3, 4).T
    np.testing.assert_array_equal(decode_tensor(encode_tensor(a), MB), a)


@pytest.mark.parametrize("shape", [(0,), (0, 64), (5, 0), (1, 0, 3, 2)])
def test_zero_length_dims_round_trip(shape):
    a = np.zeros(shape, dtype=np.float32)
    b = decode_tensor(encode_tensor(a), MB)
    assert b.shape == shape and b.dtype == np.float32


@pytest.mark.parametrize("dtype", [">f4", ">i8"])
def test_big_endian_input_is_encoded_little_endian(dtype):
    a = np.array([1.5, -2.0, 3.25], dtype=dtype)
    t = encode_tensor(a)
    assert t.data == np.array([1.5, -2.0, 3.25], dtype="<" + dtype[1:]).tobytes()
    b = decode_tensor(t, MB)
    assert b.dtype.isnative
    np.testing.assert_array_equal(a, b)


def test_decoded_tensor_is_read_only_view():
    b = decode_tensor(encode_tensor(np.ones(3, np.float32)), MB)
    with pytest.raises(ValueError):
        b[0] = 2.0


@pytest.mark.parametrize(
    "a", [np.ones(2, np.float64), np.ones(2, np.int32), np.ones(2, np.uint64), np.ones(2, bool), np.array(["x"])]
)
def test_encode_rejects_other_dtypes(a):
    with pytest.raises(WireError, match="dtype"):
        encode_tensor(a)


@pytest.mark.parametrize("a", [np.array(1.0, np.float32), np.zeros((1, 1, 1, 1, 1), np.float32)])
def test_encode_rejects_dims_outside_1_to_4(a):
    with pytest.raises(WireError, match="dims"):
        encode_tensor(a)


@pytest.mark.parametrize("dtype", ["float64", "object", "", "<f4", "FLOAT32", "float32 ", "int32"])
def test_unknown_dtype_is_rejected(dtype):
    with pytest.raises(WireError, match="dtype"):
        decode_tensor(tensor(b"\0" * 8, (2,), dtype), MB)


@pytest.mark.parametrize(
    "t, match",
    [
        (tensor(b"", (2, -1)), "negative"),
        (tensor(b"\0" * 8, (-1, -2)), "negative"),
        (tensor(b"\0" * 12, (2,)), "needs 8 bytes, got 12"),  # more bytes than the shape
        (tensor(b"\0" * 4, (2,)), "needs 8 bytes, got 4"),  # fewer bytes than the shape
        (tensor(b"\0" * 8, (1,), "int64"), None),  # sanity: the same bytes as int64 [1] are fine
        (tensor(b"\0" * 16, (1,), "int64"), "needs 8 bytes"),
        (tensor(b"\0" * 4, (1, 1, 1, 1, 1)), "dims"),
        (tensor(b"", ()), "dims"),
        (tensor(b"", (2**62, 2**62)), "needs"),  # the product overflows int64; Python ints do not
        (tensor(b"\0" * 8, (2**63 - 1, 2**63 - 1, 2**63 - 1, 2)), "needs"),
        (tensor(b"", (0, 2**62)), "exceeds"),  # empty, but no real tensor has such a dim (numpy refuses it)
    ],
)
def test_malformed_tensors_are_rejected(t, match):
    if match is None:
        decode_tensor(t, MB)
        return
    with pytest.raises(WireError, match=match):
        decode_tensor(t, MB)


def test_tensor_over_max_bytes_is_rejected():
    t = encode_tensor(np.zeros(257, np.float32))
    assert decode_tensor(t, 1028).shape == (257,)
    with pytest.raises(WireError, match="exceeds the limit"):
        decode_tensor(t, 1024)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_floats_are_rejected(bad):
    a = np.ones((2, 3), np.float32)
    a[1, 2] = bad
    with pytest.raises(WireError, match="NaN or infinity"):
        decode_tensor(encode_tensor(a), MB)


# --- topology and results --------------------------------------------------------------------------------


@pytest.mark.parametrize("node", [make_node(), make_node(pinned=None, loaded=(), active_requests=0, status={})])
def test_node_info_round_trip(node):
    back = decode_node_info(encode_node_info(node))
    assert back == node and back.status == node.status  # status is compare=False: check it separately


def test_node_info_pinned_is_optional_on_the_wire():
    assert not encode_node_info(make_node(pinned=None)).HasField("pinned")
    assert encode_node_info(make_node(pinned=(0, 8))).pinned.model_id == "m"


def _node_msg() -> pb.NodeInfo:
    return encode_node_info(make_node())


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: setattr(m, "node_id", ""),
        lambda m: setattr(m, "address", "nowhere"),
        lambda m: setattr(m, "address", "host:0"),
        lambda m: m.ClearField("capabilities"),
        lambda m: setattr(m.capabilities, "n_layers", -1),
        lambda m: setattr(m.capabilities, "engine", ""),
        lambda m: setattr(m.pinned, "end_layer", 17),
        lambda m: setattr(m.pinned, "start_layer", 8),
        lambda m: setattr(m.pinned, "model_id", "other"),
        lambda m: setattr(m.loaded[0], "end_layer", 0),
        lambda m: setattr(m, "active_requests", -1),
        lambda m: m.status.__setitem__("", 1),
        lambda m: setattr(m, "link_port", 70000),
    ],
)
def test_invalid_node_info_is_rejected_naming_the_node_once(mutate):
    m = _node_msg()
    mutate(m)
    with pytest.raises(WireError) as e:
        decode_node_info(m)
    if m.node_id:
        assert str(e.value).startswith(f"node {m.node_id!r}: ") and str(e.value).count(m.node_id) == 1


@pytest.mark.parametrize(
    "r",
    [
        SampleResult(7),
        SampleResult(0, 0.0),
        SampleResult(151645, -0.25, ((151645, -0.25), (3, -1.5), (9, -12.125))),
        SampleResult(5, -0.7, ((5, -0.7), (6, -2.3))),  # float32 on the wire, exact decimals back
    ],
)
def test_result_round_trip(r):
    assert decode_result(encode_result(r)) == r


def test_result_logprob_presence():
    assert not encode_result(SampleResult(1)).HasField("logprob")
    assert encode_result(SampleResult(1, 0.0)).HasField("logprob")


@pytest.mark.parametrize(
    "m",
    [
        pb.TokenResult(token=-1),
        pb.TokenResult(token=1, logprob=float("nan")),
        pb.TokenResult(token=1, logprob=float("inf")),
        pb.TokenResult(token=1, top_logprobs=[pb.TopLogprob(token=-2, logprob=-1)]),
        pb.TokenResult(token=1, top_logprobs=[pb.TopLogprob(token=2, logprob=float("nan"))]),
        pb.TokenResult(token=1, top_logprobs=[pb.TopLogprob(token=2, logprob=-1)] * 21),
    ],
)
def test_invalid_results_are_rejected(m):
    with pytest.raises(WireError):
        decode_result(m)


# --- hostile bytes ---------------------------------------------------------------------------------------


def _decode_entries(raw: bytes) -> int:
    """Parse like the server does: only DecodeError (bad protobuf) or WireError (bad content) may escape."""
    try:
        req = pb.SendRequest.FromString(raw)
    except DecodeError:
        return 0
    for e in req.entries:
        for decode in (lambda: decode_tensor(e.tensor, MB), lambda: decode_spec(e.spec)):
            try:
                decode()
            except WireError:
                pass
    return len(req.entries)


def test_random_bytes_raise_only_wire_errors():
    rng = random.Random(1234)
    for _ in range(300):
        _decode_entries(rng.randbytes(rng.randrange(0, 200)))


def test_mutated_valid_messages_raise_only_wire_errors():
    # Random bytes rarely parse; flipping bytes of a valid request reaches the validators far more often.
    valid = pb.SendRequest(
        entries=[pb.TensorEntry(request_id="req-1", tensor=encode_tensor(np.ones((2, 3), np.float32)), spec=spec_msg())]
    ).SerializeToString()
    rng = random.Random(5678)
    reached = 0
    for _ in range(300):
        raw = bytearray(valid)
        for _ in range(rng.randrange(1, 6)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        reached += _decode_entries(bytes(raw))
    assert reached > 20  # the test really exercises the validators


@pytest.mark.parametrize(
    "m",
    [
        TokenMessage("r1", (SampleResult(7, -0.5),)),
        TokenMessage("r1", (SampleResult(2),), finished=True, finish_reason="stop"),
        TokenMessage(
            "r1", finished=True, finish_reason="error", failure=Failure(FailureKind.LOST, "forward failed", "n2")
        ),
    ],
)
def test_token_message_round_trip(m):
    assert decode_tokens(encode_tokens(m)) == m


@pytest.mark.parametrize(
    "m",
    [
        pb.SendResultRequest(request_id=""),
        pb.SendResultRequest(request_id="r", finished=True, finish_reason="because"),
        pb.SendResultRequest(request_id="r", finish_reason="stop"),  # a reason, but not finished
        pb.SendResultRequest(request_id="r", tokens=[pb.TokenResult(token=1)] * 1025),
        pb.SendResultRequest(
            request_id="r", finished=True, finish_reason="error", failure=pb.Failure(kind=3, detail="x" * 5000)
        ),
        pb.SendResultRequest(request_id="r", finished=True, finish_reason="error"),  # an error that says nothing
        pb.SendResultRequest(request_id="r", finished=True, failure=pb.Failure(kind=3, detail="lost")),  # no error
        pb.SendResultRequest(  # a kind this version doesn't know
            request_id="r", finished=True, finish_reason="error", failure=pb.Failure(kind=99, detail="lost")
        ),
        pb.SendResultRequest(  # no kind at all
            request_id="r", finished=True, finish_reason="error", failure=pb.Failure(detail="lost")
        ),
    ],
)
def test_invalid_token_messages_are_rejected(m):
    with pytest.raises(WireError):
        decode_tokens(m)


def test_activation_round_trip_with_and_without_spec():
    spec = RequestSpec(
        "r1",
        (PlanStep("a", "h:1", Shard("m", 0, 2, 4)), PlanStep("b", "h:2", Shard("m", 2, 4, 4))),
        SamplingParams(temperature=0),
        8,
        frozenset({2}),
        "a",
        "h:1",
    )
    hidden = np.arange(6, dtype=np.float32).reshape(2, 3)
    for a in (Activation("r1", hidden, spec), Activation("r1", hidden)):
        back = decode_activation(encode_activation(a), 1 << 20)
        assert (back.request_id, back.spec) == (a.request_id, a.spec) and np.array_equal(back.data, hidden)
