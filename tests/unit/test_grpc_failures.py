"""The gRPC edge of the failure type (node/grpc/failures.py, node/grpc/wire.py): every kind crosses a call as a
status code and a request's end as a protobuf message, and comes back the same kind; the codes gRPC raises by itself
(a connection cut, a deadline) arrive as the kinds the callers act on."""

import asyncio

import grpc
import pytest

from node.core.failures import Failure, FailureKind
from node.core.requests import Refusal, TokenMessage
from node.grpc import wire
from node.grpc.client import GrpcTransport
from node.grpc.failures import STATUS, abort, failure_of
from node.grpc.generated import node_service_pb2 as pb
from node.runtime.transport import TransportError


@pytest.mark.parametrize("kind", list(FailureKind))
def test_every_kind_has_its_own_status_code_and_comes_back_from_it(kind):
    failure, _ = failure_of(STATUS[kind], "why", "h:1")
    assert failure.kind is kind and failure.node == "h:1" and "why" in failure.detail
    assert len(set(STATUS.values())) == len(FailureKind)


@pytest.mark.parametrize(
    "code, kind, how",
    [
        (grpc.StatusCode.UNAVAILABLE, FailureKind.LOST, "unavailable"),
        (grpc.StatusCode.CANCELLED, FailureKind.LOST, "unavailable"),  # the peer left mid-call
        (grpc.StatusCode.INTERNAL, FailureKind.LOST, "unavailable"),  # the connection broke mid-stream
        (grpc.StatusCode.DEADLINE_EXCEEDED, FailureKind.LOST, "timeout"),  # maybe only slow: membership tolerates it
        (grpc.StatusCode.RESOURCE_EXHAUSTED, FailureKind.BUSY, ""),  # also gRPC's own "message too large"
        (grpc.StatusCode.PERMISSION_DENIED, FailureKind.REFUSED, ""),
        (grpc.StatusCode.UNAUTHENTICATED, FailureKind.REFUSED, ""),
        (grpc.StatusCode.NOT_FOUND, FailureKind.REFUSED, ""),
        (grpc.StatusCode.UNKNOWN, FailureKind.ERROR, ""),  # a handler's own exception
        (grpc.StatusCode.UNIMPLEMENTED, FailureKind.ERROR, ""),
    ],
)
def test_the_codes_grpc_raises_by_itself_become_the_kinds_callers_act_on(code, kind, how):
    failure, seen = failure_of(code, "", "h:1")
    assert (failure.kind, seen, failure.detail) == (kind, how, code.name)


@pytest.mark.parametrize("kind", list(FailureKind))
def test_every_kind_survives_the_wire_in_a_token_message_and_a_refusal(kind):
    failure = Failure(kind, "forward failed", "n2")
    message = TokenMessage("r1", finished=True, finish_reason="error", failure=failure)
    assert wire.decode_tokens(wire.encode_tokens(message)) == message
    assert wire.decode_refusal(wire.encode_refusal(Refusal("r1", failure))) == Refusal("r1", failure)


def test_a_refusal_that_does_not_say_why_is_malformed():
    with pytest.raises(wire.WireError, match="must say why"):
        wire.decode_refusal(pb.Rejected(request_id="r1"))
    with pytest.raises(wire.WireError, match="unknown failure kind"):
        wire.decode_refusal(pb.Rejected(request_id="r1", failure=pb.Failure(detail="why")))


def test_a_handler_aborting_with_a_failure_reaches_the_caller_as_a_transport_error_of_that_kind():
    """A real server whose HealthCheck aborts with each kind in turn, called through the client the node uses."""
    kinds = list(FailureKind)

    async def health_check(request, context):
        await abort(context, Failure(kinds[calls.pop(0)], "why not", "n2"))

    async def go():
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(
            health_check,
            request_deserializer=pb.HealthCheckRequest.FromString,
            response_serializer=pb.HealthCheckResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("exo_node.NodeService", {"HealthCheck": handler})]
        )
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        transport, errors = GrpcTransport(), []
        try:
            for _ in kinds:
                with pytest.raises(TransportError) as e:
                    await transport.health_check(address, timeout=5)
                errors.append(e.value)
        finally:
            await transport.close()
            await server.stop(0)
        return address, errors

    calls = list(range(len(kinds)))
    address, errors = asyncio.run(go())
    assert [e.kind for e in errors] == kinds
    assert all(e.failure.node == address for e in errors)  # the peer called, as the caller knows it
    assert all("node n2: why not" in e.failure.detail for e in errors)
    assert [e.retryable for e in errors] == [k is FailureKind.LOST for k in kinds]
