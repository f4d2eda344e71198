"""The gRPC service side of the transport: decode and validate what peers send (once, here), hand typed values to
the node, and map bad input to INVALID_ARGUMENT."""
from __future__ import annotations

from typing import Protocol

import grpc
import numpy as np

from proto import node_service_pb2 as pb
from proto import node_service_pb2_grpc as pb_grpc

from . import wire
from .peer import channel_options
from .plan import Busy, PlanError, RequestSpec
from .requests import Activation, Refusal, TokenMessage
from .topology import NodeInfo


class Handler(Protocol):
    """What the service needs of a node."""

    max_tensor_bytes: int

    def accept_prompt(self, spec: RequestSpec, tokens: np.ndarray) -> None: ...
    def accept_activations(self, activations: list[Activation]) -> list[Refusal]: ...
    def accept_tokens(self, message: TokenMessage) -> None: ...
    def end_request(self, request_id: str, reason: str) -> None: ...
    def peer_leaving(self, node_id: str) -> None: ...
    def info(self) -> NodeInfo: ...


class NodeServicer(pb_grpc.NodeServiceServicer):
    def __init__(self, node: Handler):
        self.node = node

    async def SendPrompt(self, request: pb.SendPromptRequest, context: grpc.aio.ServicerContext) -> pb.Ack:
        try:
            spec = wire.decode_spec(request.spec)
            self.node.accept_prompt(spec, wire.decode_tensor(request.tokens, self.node.max_tensor_bytes))
        except Busy as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (wire.WireError, PlanError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.Ack()

    async def SendTensor(self, request: pb.SendTensorRequest, context: grpc.aio.ServicerContext) -> pb.SendTensorResponse:
        try:
            activations = wire.decode_activation_batch(request, self.node.max_tensor_bytes)
        except wire.WireError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        refused = self.node.accept_activations(activations)
        return pb.SendTensorResponse(rejected=[wire.encode_refusal(r) for r in refused])

    async def SendResults(self, request: pb.SendResultsRequest, context: grpc.aio.ServicerContext) -> pb.Ack:
        try:
            messages = wire.decode_token_batch(request)
        except wire.WireError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        for message in messages:
            self.node.accept_tokens(message)
        return pb.Ack()

    async def EndRequest(self, request: pb.EndRequestRequest, context: grpc.aio.ServicerContext) -> pb.Ack:
        self.node.end_request(request.request_id, request.reason[:32])
        return pb.Ack()

    async def HealthCheck(self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext) -> pb.HealthCheckResponse:
        return pb.HealthCheckResponse(ok=True, node=wire.encode_node_info(self.node.info()))

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.Ack:
        self.node.peer_leaving(request.node_id[:256])
        return pb.Ack()


class GrpcServer:
    """The node's gRPC server: the port is bound first (so the node's address is known before the node is built),
    the service is attached and started afterwards."""

    def __init__(self, host: str, port: int, max_message_bytes: int):
        self.server = grpc.aio.server(options=channel_options(max_message_bytes))
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen for gRPC on {host}:{port}")

    async def start(self, node: Handler) -> None:
        pb_grpc.add_NodeServiceServicer_to_server(NodeServicer(node), self.server)
        await self.server.start()

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
