"""A node holds connections only to the peers it still reaches: an address that never answers a health check, and a
peer that left (a `Leave`, then silence), keep no gRPC channel, data-path stream or stream reader task."""

import asyncio

from discovery.static import StaticDiscovery
from node.grpc.client import DEFAULT_MAX_MESSAGE_BYTES, GrpcTransport
from node.grpc.server import GrpcServer
from node.runtime.membership import Membership
from node.runtime.node import Node
from node.runtime.settings import NodeSettings, ServedModel
from node.runtime.transport import TransportError
from shards.engines.registry import engine_factory
from shards.formats.config import ModelConfig
from shards.formats.tokenizer import Tokenizer
from tests.conftest import FIXTURES
from tests.support.cluster import free_port

MODEL = FIXTURES / "llama"


def held(transport: GrpcTransport) -> dict[str, int]:
    """What the transport keeps open: channels, streams, and stream reader tasks still running."""
    readers = [s.reader for _, s in transport.streams.values() if s.reader is not None and not s.reader.done()]
    return {"channels": len(transport.channels), "streams": len(transport.streams), "readers": len(readers)}


NOTHING = {"channels": 0, "streams": 0, "readers": 0}


async def serving(node_id: str) -> tuple[Node, GrpcServer, GrpcTransport]:
    server = GrpcServer("127.0.0.1", 0, DEFAULT_MAX_MESSAGE_BYTES)
    transport = GrpcTransport(rpc_timeout=2.0)
    node = Node(
        NodeSettings(node_id=node_id, memory_bytes=1 << 30, speed=1.0),  # no calibration passes
        ServedModel("llama", MODEL, ModelConfig.from_dir(MODEL), Tokenizer(MODEL)),
        address=f"127.0.0.1:{server.port}",
        engines=engine_factory("numpy"),
        transport=transport,
    )
    node.start()
    await server.start(node)
    return node, server, transport


def test_addresses_that_never_answer_keep_no_channel():
    async def go():
        dead = [f"127.0.0.1:{free_port()}" for _ in range(5)]
        transport = GrpcTransport(rpc_timeout=0.3)
        try:  # the data path tried one of them too: a stream and its reader were opened for it
            await transport.send(dead[0], (), ())
        except TransportError:
            pass
        assert held(transport)["streams"] == 1
        membership = Membership(
            "me", "127.0.0.1:1", transport, [StaticDiscovery(dead)], lambda peers, alive: None, check_timeout=0.2
        )
        for _ in range(3):
            await membership.refresh()
            assert membership.peers == {}
            assert held(transport) == NOTHING, "a channel is kept for an address that never answered"
        await transport.close()

    asyncio.run(go())


def test_a_peer_that_left_keeps_its_channel_while_it_drains_and_none_once_it_is_gone():
    async def go():
        node, server, transport = await serving("a")
        peer, peer_server, peer_transport = await serving("b")
        membership = Membership(
            "a", node.address, transport, [StaticDiscovery([peer.address])], node.update_peers, check_timeout=0.5
        )
        await membership.refresh()
        assert [p.node_id for p in node.peers()] == ["b"]
        await transport.send(peer.address, (), ())  # the data path to b: a stream with its reader
        assert held(transport) == {"channels": 1, "streams": 1, "readers": 1}

        peer.start_draining()
        await peer_transport.leave(node.address, "b")  # b leaves cleanly ...
        assert node.peers() == ()
        await membership.refresh()  # ... and finishes its requests with us meanwhile: its connection stays
        assert held(transport) == {"channels": 1, "streams": 1, "readers": 1}

        await peer_server.stop(0)  # b is gone
        await membership.refresh()
        assert held(transport) == NOTHING, "the connection to a peer that left is kept"

        await peer.stop()
        await peer_transport.close()
        await server.stop(0)
        await node.stop()
        await transport.close()

    asyncio.run(go())
