"""gRPC service: decode and validate what peers send, hand it to the Node, map bad input to INVALID_ARGUMENT."""
from __future__ import annotations

import grpc

from proto import node_service_pb2 as pb
from proto import node_service_pb2_grpc as pb_grpc

from . import wire
from .node import Node
from .peer import channel_options
from .plan import PlanError


class NodeServicer(pb_grpc.NodeServiceServicer):
    def __init__(self, node: Node):
        self.node = node

    async def SendPrompt(self, request: pb.SendPromptRequest, context: grpc.aio.ServicerContext) -> pb.Ack:
        try:
            spec = wire.decode_spec(request.spec)
            tokens = wire.decode_tensor(request.tokens, self.node.settings.max_tensor_bytes)
            self.node.accept_prompt(spec, tokens)
        except (wire.WireError, PlanError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.Ack()

    async def SendTensor(self, request: pb.SendTensorRequest, context: grpc.aio.ServicerContext) -> pb.SendTensorResponse:
        try:
            entries = [
                (
                    e.request_id,
                    wire.decode_tensor(e.tensor, self.node.settings.max_tensor_bytes),
                    wire.decode_spec(e.spec) if e.HasField("spec") else None,
                )
                for e in request.entries
            ]
        except wire.WireError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rejected = self.node.accept_tensors(entries)
        return pb.SendTensorResponse(rejected=[pb.Rejected(request_id=r, reason=why) for r, why in rejected])

    async def SendResult(self, request: pb.SendResultRequest, context: grpc.aio.ServicerContext) -> pb.Ack:
        try:
            for t in request.tokens:
                wire.decode_result(t)
        except wire.WireError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.node.accept_result(request)
        return pb.Ack()

    async def EndRequest(self, request: pb.EndRequestRequest, context: grpc.aio.ServicerContext) -> pb.Ack:
        self.node.end_request(request.request_id, request.reason[:32])
        return pb.Ack()

    async def CollectTopology(self, request: pb.CollectTopologyRequest, context: grpc.aio.ServicerContext) -> pb.Topology:
        return wire.encode_topology(self.node.topology())

    async def HealthCheck(self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext) -> pb.HealthCheckResponse:
        return pb.HealthCheckResponse(ok=True, node=wire.encode_node_info(self.node.info()))


async def start_server(node: Node, host: str, port: int, max_message_bytes: int) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns the server and the bound port (port 0 picks a free one)."""
    server = grpc.aio.server(options=channel_options(max_message_bytes))
    pb_grpc.add_NodeServiceServicer_to_server(NodeServicer(node), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {host}:{port}")
    await server.start()
    return server, bound
