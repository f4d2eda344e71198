"""The gRPC service side of the transport: decode and validate what peers send (once, here), hand typed values to
the node, and map bad input to INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import grpc
import numpy as np

from node.core.failures import Failed, Failure, FailureKind
from node.core.plan import MAX_REQUEST_ID, PlanError, RequestSpec
from node.core.requests import Activation, Refusal, TokenMessage
from node.core.topology import NodeInfo
from node.fetch.manifest import piece_deadline
from node.fetch.source import FetchRefused, WeightSource
from node.grpc import wire, wire_cluster
from node.grpc.client import server_options
from node.grpc.failures import abort
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.generated import node_service_pb2_grpc as pb_grpc
from node.security import peer_node_id

if TYPE_CHECKING:  # node.security.tls loads cryptography: only a node with a cluster key needs it
    from node.security.tls import NodeTls


class Handler(Protocol):
    """What the service needs of a node."""

    max_tensor_bytes: int

    # `caller`: the calling member's node id from its TLS certificate, or None without a cluster key
    def accept_prompt(self, spec: RequestSpec, tokens: np.ndarray, caller: str | None) -> None: ...
    def accept_activations(
        self, activations: list[Activation], caller: str | None, *, received: float | None = None
    ) -> list[Refusal]: ...
    def accept_tokens(self, message: TokenMessage, caller: str | None) -> None: ...
    def relay_row(self, request_id: str, data: np.ndarray, caller: str | None, received: float) -> bool: ...
    def would_relay(self, request_id: str, data: np.ndarray, caller: str | None) -> bool: ...
    def warm_with(self, warm: Callable[[], None]) -> None: ...
    def end_request(
        self, request_id: str, reason: str, caller: str | None, branch: tuple[str, int] | None = None
    ) -> None: ...
    def peer_leaving(self, node_id: str, caller: str | None) -> None: ...
    def info(self) -> NodeInfo: ...


def take_send(
    node: Handler, request: pb.SendRequest, caller: str | None, received: float
) -> tuple[pb.SendResponse, bool]:
    """One data-path message handed to the node, from gRPC's stream or the data link (node/grpc/link/): its answer (the
    activations refused) and whether it fed the engine (the answer then waits a loop round, so the pass starts
    first). A wire.WireError for a malformed message, before the node sees any of it."""
    activations, messages = wire.decode_send(request, node.max_tensor_bytes)
    refused = accept_send(node, activations, messages, caller, received)
    return pb.SendResponse(rejected=[wire.encode_refusal(r) for r in refused]), bool(activations)


def accept_send(
    node: Handler, activations: list[Activation], messages: list[TokenMessage], caller: str | None, received: float
) -> list[Refusal]:
    """A data-path message's items, decoded and checked, handed to the node: the activations it refused."""
    refused = node.accept_activations(activations, caller, received=received) if activations else []
    for message in messages:
        node.accept_tokens(message, caller)
    return refused


class NodeServicer(pb_grpc.NodeServiceServicer):
    def __init__(self, node: Handler, source: WeightSource | None = None):
        self.node, self.source = node, source  # source: the weights this node hands to peers (None: none)

    async def SendPrompt(self, request: pb.SendPromptRequest, context: grpc.aio.ServicerContext) -> pb.Ack:
        try:
            spec = wire.decode_spec(request.spec)
            self.node.accept_prompt(
                spec, wire.decode_tensor(request.tokens, self.node.max_tensor_bytes), peer_node_id(context)
            )
        except Failed as e:
            await abort(context, e.failure)
        except (wire.WireError, PlanError) as e:
            await abort(context, Failure(FailureKind.REFUSED, str(e)))
        return pb.Ack()

    async def SendStream(self, requests, context: grpc.aio.ServicerContext):
        """The data path: each message (activations, token messages) is answered with the activations refused."""
        caller = peer_node_id(context)
        async for request in requests:
            try:
                answer, fed = take_send(self.node, request, caller, time.perf_counter())
            except wire.WireError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if fed:
                await asyncio.sleep(0)  # the worker first: the pass these feed starts before the answer is written
            yield answer

    async def EndRequest(self, request: pb.EndRequestRequest, context: grpc.aio.ServicerContext) -> pb.Ack:
        try:
            branch = wire.decode_branch(request)
        except wire.WireError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.node.end_request(
            request.request_id[:MAX_REQUEST_ID], request.reason[:32], peer_node_id(context), branch=branch
        )
        return pb.Ack()

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        return pb.HealthCheckResponse(ok=True, node=wire_cluster.encode_node_info(self.node.info()))

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.Ack:
        self.node.peer_leaving(request.node_id[:256], peer_node_id(context))
        return pb.Ack()

    async def GetManifest(self, request: pb.ManifestRequest, context: grpc.aio.ServicerContext) -> pb.Manifest:
        if self.source is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "this node serves no weights")
        try:
            return wire_cluster.encode_manifest(await self.source.manifest(request.model_id[: wire.MAX_MODEL_ID]))
        except FetchRefused as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))

    async def FetchPiece(self, request: pb.PieceRequest, context: grpc.aio.ServicerContext):
        if self.source is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "this node serves no weights")
        try:
            transfer = await self.source.open(request.model_id[: wire.MAX_MODEL_ID], request.piece)
        except FetchRefused as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except Failed as e:  # its upload slots are full
            await abort(context, e.failure)
        except OSError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot read the piece: {e.strerror or e}")
        # A caller that stops reading (and set no deadline) must not hold the upload slot forever: the transfer gets
        # the time the fetcher's own deadline gives the piece. (Written with context.write, not yielded, so the
        # time limit covers the writes too.)
        try:  # the upload slot is freed however the stream ends: done, failed, cancelled by the fetcher or timed out
            async with asyncio.timeout(piece_deadline(transfer.length)):
                await context.write(pb.PieceChunk(sha256=transfer.sha256, length=transfer.length))
                async for data in transfer.chunks:
                    await context.write(pb.PieceChunk(data=data))
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the piece took longer than its transfer may")
        except (FetchRefused, OSError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot read the piece: {e}")
        finally:
            transfer.close()
            await transfer.chunks.aclose()  # its file now, not when the generator is collected


class GrpcServer:
    """The node's gRPC server: the port is bound first (so the node's address is known before the node is built),
    the service is attached and started afterwards. With `tls` (a cluster key) it only speaks mutual TLS: a caller
    without a certificate from the cluster's key fails the handshake before any RPC."""

    def __init__(self, host: str, port: int, max_message_bytes: int, tls: NodeTls | None = None):
        self.server = grpc.aio.server(options=server_options(max_message_bytes), maximum_concurrent_rpcs=4096)
        address = f"{host}:{port}"
        self.port = (
            self.server.add_secure_port(address, tls.server_credentials())
            if tls
            else self.server.add_insecure_port(address)
        )
        if self.port == 0:
            raise OSError(f"cannot listen for gRPC on {host}:{port}")

    async def start(self, node: Handler, source: WeightSource | None = None) -> None:
        pb_grpc.add_NodeServiceServicer_to_server(NodeServicer(node, source), self.server)
        await self.server.start()

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
