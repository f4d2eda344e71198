"""The data link between two nodes, over real loopback sockets: the gRPC stream's messages, answered in order,
validated before the node sees them; bad input refused in-band and the connection ended; every message with a
deadline; a link used once it is up and never waited for. With a cluster key: test_link_tls.py."""

import asyncio
import contextlib
import time

import grpc
import numpy as np
import pytest

from node.core.failures import Failure, FailureKind
from node.core.requests import Activation, Refusal, TokenMessage
from node.core.topology import Capabilities, NodeInfo
from node.grpc import wire
from node.grpc.client import GrpcTransport
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.link import packed
from node.grpc.link.client import LinkConnection, PeerLinks
from node.grpc.link.frames import DATA, ERROR, GREETING, HEADER, FrameReader, frame
from node.grpc.link.server import LinkServer
from node.grpc.server import GrpcServer
from node.grpc.stream import StreamBroken
from shards.decoding.sampling import SampleResult
from tests.support.cluster import free_port

BOUND = 1 << 20


class Node:
    """What the link hands messages to (the server's `Handler`): records them in order; refuses the activations
    of requests named bad*, as a busy node does."""

    max_tensor_bytes = BOUND - 4096

    def __init__(self, link_port: int = 0, address: str = "127.0.0.1:1"):
        self.arrived: list[str] = []
        self.callers: list[str | None] = []
        self.asked: list[tuple] = []  # what `would_relay` was asked
        self.link_port, self.address = link_port, address

    def accept_activations(self, activations, caller, *, received=None):
        self.arrived += [a.request_id for a in activations]
        self.callers.append(caller)
        busy = Failure(FailureKind.BUSY, "no room", "peer")
        return [Refusal(a.request_id, busy) for a in activations if a.request_id.startswith("bad")]

    def accept_tokens(self, message, caller):
        self.arrived.append(f"tokens:{message.request_id}")

    def relay_row(self, request_id, data, caller, received):
        """A decode row's input taken the short way: those of requests named relay* (whose pass waits for them)."""
        if not request_id.startswith("relay"):
            return False
        self.arrived.append(f"relayed:{request_id}")
        self.callers.append(caller)
        return True

    def would_relay(self, request_id, data, caller):
        self.asked.append((request_id, data.tolist(), caller))
        return request_id.startswith("relay")

    def warm_with(self, warm):
        self.warm = warm  # (the node's pipeline calls it while the ring leaves it idle)

    def info(self) -> NodeInfo:
        return NodeInfo("peer", self.address, Capabilities(1 << 30, "numpy", "m", 6), link_port=self.link_port)


def counts(messages: int, packed: int = 0, rows: int = 0, refused: int = 0, warmed: int = 0) -> dict[str, int]:
    """A link server's counters (`LinkServer.counters`)."""
    return {
        "link_messages": messages,
        "link_packed": packed,
        "link_rows": rows,
        "link_refused": refused,
        "link_warmed": warmed,
    }


def send_of(*names: str) -> pb.SendRequest:
    rows = tuple(Activation(n, np.zeros((1, 8), np.float32)) for n in names)
    return wire.encode_send(rows, ())


def refused(answer: pb.SendResponse) -> list[str]:
    return [wire.decode_refusal(r).request_id for r in answer.rejected]


async def link_pair(stall_s: float = 10.0, timeout: float = 2.0) -> tuple[LinkServer, Node, LinkConnection]:
    server, node = LinkServer("127.0.0.1", 0, BOUND, stall_s=stall_s), Node()
    await server.start(node)
    return server, node, await LinkConnection.open("127.0.0.1", server.port, BOUND, timeout)


async def raw(port: int, data: bytes, wait: float = 2.0) -> bytes:
    """What the server writes back to a stranger who sends `data`, until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        async with asyncio.timeout(wait):
            return await reader.read(1 << 16) + await reader.read(1 << 16)
    finally:
        writer.close()


def test_messages_cross_the_link_and_are_answered_in_order():
    async def go():
        server, node, link = await link_pair()
        names = [f"bad{i}" if i % 3 == 0 else f"m{i}" for i in range(60)]
        answers = await asyncio.gather(*(link.send(send_of(n)) for n in names))
        assert [refused(a) for a in answers] == [[n] if n.startswith("bad") else [] for n in names]
        message = TokenMessage("r", (SampleResult(5),))
        await link.send(wire.encode_send((), (message,)))
        assert node.arrived == [*names, "tokens:r"]
        assert server.counters == counts(61)
        link.close()
        await server.stop()

    asyncio.run(go())


def test_a_malformed_message_is_refused_in_band_and_ends_the_link():
    async def go():
        server, node, link = await link_pair()
        bad = pb.SendRequest(entries=[pb.TensorEntry(request_id="x")])  # no tensor: wire.decode_send refuses it
        with pytest.raises(StreamBroken) as e:
            await link.send(bad)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "tensor" in e.value.details
        assert link.closed and node.arrived == [] and server.counters["link_refused"] == 1
        with pytest.raises(StreamBroken):  # a closed link takes nothing more
            await link.send(send_of("m"))
        await server.stop()

    asyncio.run(go())


def test_packed_messages_cross_among_send_requests_and_are_answered_in_order():
    async def go():
        server, node, link = await link_pair()
        names = [f"bad{i}" if i % 3 == 0 else f"m{i}" for i in range(40)]
        row = np.zeros((1, 8), np.float32)
        sent = [packed.pack((Activation(n, row),), ()) if i % 2 else send_of(n) for i, n in enumerate(names)]
        answers = await asyncio.gather(*(link.send(m) for m in sent))
        assert [refused(a) for a in answers] == [[n] if n.startswith("bad") else [] for n in names]
        await link.send(packed.pack((), (TokenMessage("r", (SampleResult(5, -0.5),), True, "stop"),)))
        assert node.arrived == [*names, "tokens:r"]
        assert server.counters == counts(41, packed=21)
        link.close()
        await server.stop()

    asyncio.run(go())


def test_a_decode_rows_input_goes_the_short_way_where_the_node_takes_it_there_with_its_tokens_after():
    async def go():
        server, node, link = await link_pair()
        row, token = np.ones((1, 8), np.float32), TokenMessage("relay2", (SampleResult(5, -0.5),))
        messages = [
            packed.pack((Activation("relay1", row),), ()),  # taken the short way
            packed.pack((Activation("relay2", np.array([5])),), (token,)),  # a first node's: the token, its delivery
            packed.pack((Activation("bad1", row),), ()),  # not taken there: the usual way, refused
            packed.pack((Activation("m1", row),), ()),  # the usual way, taken
            packed.pack((Activation("relay3", np.ones((2, 8), np.float32)),), ()),  # two rows: never the short way
        ]
        answers = [refused(await link.send(m)) for m in messages]
        assert answers == [[], [], ["bad1"], [], []]
        assert node.arrived == ["relayed:relay1", "relayed:relay2", "tokens:relay2", "bad1", "m1", "relay3"]
        assert server.counters == counts(5, packed=5, rows=2)
        link.close()
        await server.stop()

    asyncio.run(go())


def test_warming_runs_the_short_way_on_each_connections_last_row_taken_that_way_and_takes_nothing():
    async def go():
        server, node, link = await link_pair()
        other = await LinkConnection.open("127.0.0.1", server.port, BOUND, 2.0)
        node.warm()  # (the node's pipeline calls it while the ring leaves it idle: nothing taken yet)
        assert node.asked == [] and server.counters["link_warmed"] == 0
        await link.send(packed.pack((Activation("relay1", np.full((1, 8), 1, np.float32)),), ()))
        await link.send(packed.pack((Activation("relay2", np.full((1, 8), 2, np.float32)),), ()))
        await link.send(packed.pack((Activation("m1", np.ones((1, 8), np.float32)),), ()))  # the usual way
        await other.send(packed.pack((Activation("relay3", np.array([7])),), ()))
        arrived = list(node.arrived)
        node.warm()
        assert sorted(node.asked) == [("relay2", [[2.0] * 8], None), ("relay3", [7], None)]
        assert node.arrived == arrived and server.counters["link_rows"] == 3 and server.counters["link_warmed"] == 2
        link.close()
        other.close()
        await server.stop()

    asyncio.run(go())


def test_a_malformed_packed_message_is_refused_in_band_and_ends_the_link():
    async def go():
        server, node, link = await link_pair()
        with pytest.raises(StreamBroken) as e:
            await link.send(packed.pack((Activation("m", np.zeros((1, 8), np.float32)),), ())[:-4])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "needs 32 bytes, got 28" in e.value.details
        assert link.closed and node.arrived == [] and server.counters["link_refused"] == 1
        await server.stop()

    asyncio.run(go())


def test_a_frame_over_the_models_bound_is_refused_before_it_is_held():
    async def go():
        server = LinkServer("127.0.0.1", 0, BOUND)
        await server.start(Node())
        back = await raw(server.port, GREETING + HEADER.pack(BOUND + 1, DATA))
        assert back.startswith(GREETING)
        (kind, payload), *_ = FrameReader(BOUND).feed(back[len(GREETING) :])
        assert kind == ERROR and payload.startswith(b"INVALID_ARGUMENT") and b"over the bound" in payload
        await server.stop()

    asyncio.run(go())


def test_a_stranger_without_the_greeting_gets_not_one_byte():
    async def go():
        server = LinkServer("127.0.0.1", 0, BOUND)
        await server.start(Node())
        assert await raw(server.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == b""
        assert await raw(server.port, b"EXO-LINK\x01\x00") == b""  # another version of the link: closed as well
        await server.stop()

    asyncio.run(go())


def test_a_half_sent_frame_ends_the_connection_after_the_stall_time():
    async def go():
        server = LinkServer("127.0.0.1", 0, BOUND, stall_s=0.2)
        await server.start(Node())
        began = time.monotonic()
        back = await raw(server.port, GREETING + frame(DATA, b"x" * 100)[:50], wait=3.0)
        assert back == GREETING and 0.15 < time.monotonic() - began < 2.0
        await server.stop()

    asyncio.run(go())


def test_an_answer_that_does_not_come_in_time_fails_every_message_waiting_on_the_link():
    async def go():
        async def mute(reader, writer):  # greets, reads, never answers
            writer.write(GREETING)
            while await reader.read(1 << 16):
                pass

        server = await asyncio.start_server(mute, "127.0.0.1", 0)
        link = await LinkConnection.open("127.0.0.1", server.sockets[0].getsockname()[1], BOUND, timeout=0.3)
        began = time.monotonic()
        results = await asyncio.gather(link.send(send_of("a")), link.send(send_of("b")), return_exceptions=True)
        assert [r.code for r in results] == [grpc.StatusCode.DEADLINE_EXCEEDED] * 2
        assert time.monotonic() - began < 1.5 and link.closed
        server.close()

    asyncio.run(go())


def test_a_link_is_used_once_up_and_never_waited_for():
    async def go():
        server = LinkServer("127.0.0.1", 0, BOUND)
        await server.start(Node())
        links = PeerLinks(BOUND, timeout=2.0)
        links.learn("127.0.0.1:7", server.port)
        assert links.get("127.0.0.1:7") is None  # connecting in the background: the gRPC stream meanwhile
        for _ in range(200):
            if (link := links.get("127.0.0.1:7")) is not None:
                break
            await asyncio.sleep(0.01)
        assert refused(await link.send(send_of("bad"))) == ["bad"]
        links.learn("127.0.0.1:7", server.port + 1)  # the peer restarted on another port: the old link goes
        assert link.closed and links.get("127.0.0.1:7") is None
        await links.close()
        await server.stop()

    asyncio.run(go())


def test_a_link_that_cannot_be_had_is_tried_again_only_after_a_growing_wait():
    async def go():
        links = PeerLinks(BOUND, timeout=2.0, retry_s=0.3)
        links.learn("127.0.0.1:7", free_port())  # nothing listens there
        assert links.get("127.0.0.1:7") is None
        await asyncio.sleep(0.1)  # the attempt fails at once (refused)
        assert links.get("127.0.0.1:7") is None and "127.0.0.1:7" not in links.connecting  # waiting out 0.3 s
        await asyncio.sleep(0.35)
        assert links.get("127.0.0.1:7") is None and "127.0.0.1:7" in links.connecting  # tried again
        await asyncio.sleep(0.1)
        assert links.backoff["127.0.0.1:7"][1] == pytest.approx(1.2)  # 0.3, then 0.6, next 1.2
        await links.close()

    asyncio.run(go())


@contextlib.asynccontextmanager
async def peer_with_a_link():
    """A peer serving gRPC and a data link into one recording `Node`, and a transport that knows of neither yet:
    (transport, the peer's address, its node, its link server)."""
    link = LinkServer("127.0.0.1", 0, BOUND)
    grpc_server = GrpcServer("127.0.0.1", 0, BOUND)
    address = f"127.0.0.1:{grpc_server.port}"
    node = Node(link.port, address)
    await grpc_server.start(node)
    await link.start(node)
    transport = GrpcTransport(BOUND, rpc_timeout=2.0)
    try:
        yield transport, address, node, link
    finally:
        await transport.close()
        await link.stop()
        await grpc_server.stop(None)


def test_the_transport_learns_a_peers_link_from_its_health_check_and_sends_on_it():
    async def go():
        async with peer_with_a_link() as (transport, address, node, link):
            row = (Activation("bad0", np.zeros((1, 8), np.float32)),)
            assert [r.request_id for r in await transport.send(address, row, ())] == ["bad0"]  # on gRPC: no port known
            assert (await transport.health_check(address)).link_port == link.port
            for i in range(1, 300):
                refusals = await transport.send(address, (Activation(f"bad{i}", row[0].data),), ())
                assert [r.request_id for r in refusals] == [f"bad{i}"]
                if link.counters["link_messages"]:
                    break
                await asyncio.sleep(0.01)
            assert link.counters["link_messages"] == 1 and node.arrived == [f"bad{j}" for j in range(i + 1)]

    asyncio.run(go())
