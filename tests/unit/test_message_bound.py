"""What a peer can make a node read whole is bounded by the model: one request's context of activations (context
x hidden x 4 bytes) and a little room, not 256 MiB a message; honest senders cut their calls to fit."""

import asyncio

import grpc
import numpy as np

from node.grpc import wire
from node.grpc.client import GrpcTransport, message_bound
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.server import GrpcServer
from node.runtime.node import Node
from node.runtime.outbox import Outbox
from node.runtime.settings import NodeSettings, ServedModel
from shards.engines.registry import engine_factory
from shards.formats.config import ModelConfig
from shards.formats.tokenizer import Tokenizer
from tests.unit.test_node_rpc import MODEL, RawClient

CFG = ModelConfig.from_dir(MODEL)


def test_the_bound_is_one_requests_context_of_activations_and_room():
    assert message_bound(hidden_size=576, context=8192) == 8192 * 576 * 4 + (1 << 20)  # SmolLM2-135M: ~20 MB
    assert message_bound(CFG.hidden_size, CFG.max_position_embeddings) == 4 << 20  # never below gRPC's default


def test_a_message_past_the_models_bound_is_refused_unread_and_the_node_serves_on():
    async def go():
        bound = message_bound(CFG.hidden_size, CFG.max_position_embeddings)
        server = GrpcServer("127.0.0.1", 0, bound)
        node = Node(
            NodeSettings(node_id="n0", memory_bytes=1 << 30, max_tensor_bytes=bound - (1 << 20)),
            ServedModel("llama", MODEL, CFG, Tokenizer(MODEL)),
            address=f"127.0.0.1:{server.port}",
            engines=engine_factory("numpy"),
            transport=GrpcTransport(bound),
        )
        node.start()
        await server.start(node)
        client = RawClient(node.address)
        try:
            flood = np.zeros(((bound + (1 << 20)) // 4 // 64, 64), np.float32)
            entry = pb.TensorEntry(request_id="r1", tensor=wire.encode_tensor(flood))
            try:
                await client.send(pb.SendRequest(entries=[entry]))
                raise AssertionError("a message past the bound was read")
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (await client.health_check()).ok
        finally:
            await client.close()
            await server.stop(0)
            await node.stop()
            await node.transport.close()

    asyncio.run(go())


def test_an_outbox_cuts_its_calls_to_the_bound_and_sends_an_oversized_item_alone():
    calls = []

    async def go():
        done = asyncio.Event()

        async def send(batch):
            calls.append(batch)

        box = Outbox(send, asyncio.ensure_future, done.set, max_bytes=100, size=lambda item: item)
        box.put(40, 40, 40, 150, 10, 90, 5)
        await asyncio.wait_for(done.wait(), 5)

    asyncio.run(go())
    assert calls == [(40, 40), (40,), (150,), (10, 90), (5,)]
    assert all(sum(c) <= 100 for c in calls if len(c) > 1)
