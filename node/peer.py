"""gRPC client for one peer: explicit message size limits and a deadline on every call."""
from __future__ import annotations

import grpc

from proto import node_service_pb2 as pb
from proto import node_service_pb2_grpc as pb_grpc

# Activations of a long prompt can be large (tokens x hidden x 4 bytes); grpc's default cap is 4 MiB.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class PeerClient:
    def __init__(self, address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, rpc_timeout: float = 30.0):
        self.address = address
        self.rpc_timeout = rpc_timeout
        self.channel = grpc.aio.insecure_channel(address, options=channel_options(max_message_bytes))
        self.stub = pb_grpc.NodeServiceStub(self.channel)

    async def send_prompt(self, request: pb.SendPromptRequest) -> None:
        await self.stub.SendPrompt(request, timeout=self.rpc_timeout)

    async def send_tensor(self, request: pb.SendTensorRequest) -> pb.SendTensorResponse:
        return await self.stub.SendTensor(request, timeout=self.rpc_timeout)

    async def send_result(self, request: pb.SendResultRequest) -> None:
        await self.stub.SendResult(request, timeout=self.rpc_timeout)

    async def end_request(self, request_id: str, reason: str) -> None:
        await self.stub.EndRequest(pb.EndRequestRequest(request_id=request_id, reason=reason), timeout=self.rpc_timeout)

    async def health_check(self, timeout: float = 2.0) -> pb.HealthCheckResponse:
        return await self.stub.HealthCheck(pb.HealthCheckRequest(), timeout=timeout)

    async def collect_topology(self, timeout: float = 5.0) -> pb.Topology:
        return await self.stub.CollectTopology(pb.CollectTopologyRequest(), timeout=timeout)

    async def close(self) -> None:
        await self.channel.close()


class PeerPool:
    """One channel per address, reused for every call."""

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, rpc_timeout: float = 30.0):
        self.max_message_bytes, self.rpc_timeout = max_message_bytes, rpc_timeout
        self.clients: dict[str, PeerClient] = {}

    def get(self, address: str) -> PeerClient:
        client = self.clients.get(address)
        if client is None:
            client = self.clients[address] = PeerClient(address, self.max_message_bytes, self.rpc_timeout)
        return client

    async def drop(self, address: str) -> None:
        client = self.clients.pop(address, None)
        if client is not None:
            await client.close()

    async def close(self) -> None:
        for address in list(self.clients):
            await self.drop(address)
