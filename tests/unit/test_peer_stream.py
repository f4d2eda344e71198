"""The data-path stream to a peer: answers in order, a deadline per message, and a fresh stream after any failure."""

import asyncio

import grpc
import pytest

from node.grpc.client import channel_options
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.generated import node_service_pb2_grpc as pb_grpc
from node.grpc.stream import PeerStream, StreamBroken
from tests.support.cluster import free_port


class Peer(pb_grpc.NodeServiceServicer):
    """Answers each message with a refusal naming it (so answers can be matched), after `delay` seconds."""

    def __init__(self, delay: float = 0.0):
        self.delay, self.streams = delay, 0

    async def SendStream(self, requests, context):
        self.streams += 1
        async for request in requests:
            await asyncio.sleep(self.delay)
            yield pb.SendResponse(rejected=[pb.Rejected(request_id=e.request_id) for e in request.entries])


async def serve(peer: Peer, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_NodeServiceServicer_to_server(peer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def message(name: str) -> pb.SendRequest:
    return pb.SendRequest(entries=[pb.TensorEntry(request_id=name)])


def answered(response) -> str:
    return response.rejected[0].request_id


def stream_to(port: int, timeout: float = 2.0) -> tuple[PeerStream, grpc.aio.Channel]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options(1 << 20))
    stub = pb_grpc.NodeServiceStub(channel)
    return PeerStream(lambda: stub.SendStream(wait_for_ready=True), timeout), channel


def test_messages_are_answered_in_order_over_one_stream():
    async def go():
        port = free_port()
        peer = Peer()
        server = await serve(peer, port)
        stream, channel = stream_to(port)
        answers = await asyncio.gather(*(stream.send(message(f"m{i}")) for i in range(50)))
        assert [answered(a) for a in answers] == [f"m{i}" for i in range(50)] and peer.streams == 1
        await stream.close()
        await channel.close()
        await server.stop(None)

    asyncio.run(go())


def test_a_message_without_an_answer_in_time_breaks_the_stream_and_the_next_gets_a_new_one():
    async def go():
        port = free_port()
        peer = Peer(delay=1.0)
        server = await serve(peer, port)
        stream, channel = stream_to(port, timeout=0.3)
        with pytest.raises(StreamBroken) as e:
            await stream.send(message("slow"))
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        peer.delay = 0.0
        assert answered(await stream.send(message("next"))) == "next" and peer.streams == 2
        await stream.close()
        await channel.close()
        await server.stop(None)

    asyncio.run(go())


def test_a_sender_cancelled_while_it_waits_leaves_the_answers_behind_it_in_order():
    async def go():
        port = free_port()
        peer = Peer(delay=0.2)
        server = await serve(peer, port)
        stream, channel = stream_to(port)
        first = asyncio.ensure_future(stream.send(message("given up")))
        await asyncio.sleep(0.05)  # written, its answer not yet come
        first.cancel()
        second = asyncio.ensure_future(stream.send(message("kept")))
        with pytest.raises(asyncio.CancelledError):
            await first
        assert answered(await second) == "kept" and peer.streams == 1  # the cancelled one's answer went nowhere
        await stream.close()
        await channel.close()
        await server.stop(None)

    asyncio.run(go())


def test_a_write_to_a_peer_that_never_comes_fails_within_the_deadline():
    """The write waits for the peer (wait_for_ready) under the message's deadline: cancelling the call does not end
    a write still waiting for a channel, so the write itself is given up, and the message fails, not hangs."""

    async def go():
        stream, channel = stream_to(free_port(), timeout=0.3)  # nothing listens there
        with pytest.raises(StreamBroken):
            await asyncio.wait_for(stream.send(message("nowhere")), 5.0)  # TimeoutError here would be the hang
        await stream.close()
        await channel.close()

    asyncio.run(go())


def test_a_peer_that_dies_fails_what_waits_at_once_and_a_restarted_one_is_reached_again():
    async def go():
        port = free_port()
        server = await serve(Peer(delay=0.5), port)
        stream, channel = stream_to(port, timeout=5.0)
        waiting = asyncio.ensure_future(stream.send(message("in flight")))
        await asyncio.sleep(0.1)
        await server.stop(None)
        started = asyncio.get_running_loop().time()
        with pytest.raises(StreamBroken):
            await waiting
        assert asyncio.get_running_loop().time() - started < 1.0  # not the 5 s deadline
        server = await serve(Peer(), port)
        assert answered(await stream.send(message("again"))) == "again"
        await stream.close()
        await channel.close()
        await server.stop(None)

    asyncio.run(go())


def test_a_peer_still_starting_is_waited_for_within_the_deadline():
    async def go():
        port = free_port()
        stream, channel = stream_to(port, timeout=5.0)
        sending = asyncio.ensure_future(stream.send(message("early")))
        await asyncio.sleep(0.5)  # the peer isn't listening yet
        server = await serve(Peer(), port)
        assert answered(await sending) == "early"
        await stream.close()
        await channel.close()
        await server.stop(None)

    asyncio.run(go())
