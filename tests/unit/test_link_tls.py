"""The data link under a cluster key (node/grpc/link/): mutual TLS as gRPC's, the caller named from its verified leaf,
no link for a peer without the cluster's leaf, a handshake left unfinished ended within the stall time, a renewed
leaf for the handshakes after it; the plain protocol is test_link.py's."""

import asyncio
import datetime as dt
import ssl
import time

import pytest

from node.grpc.client import GrpcTransport
from node.grpc.link.client import LinkConnection, PeerLinks
from node.grpc.link.frames import GREETING
from node.grpc.link.server import LinkServer
from node.grpc.stream import StreamBroken
from node.security.keys import ClusterKey, generate_secret
from node.security.peer import node_id_of
from node.security.tls import LEAF_IN_MEMORY, NodeTls
from tests.unit.test_link import BOUND, Node, raw, refused, send_of

KEY = ClusterKey(generate_secret())


def test_with_a_cluster_key_the_link_is_mutual_tls_and_names_its_caller():
    async def go():
        server, node = LinkServer("127.0.0.1", 0, BOUND, tls=KEY.tls("srv")), Node()
        await server.start(node)
        client = KEY.tls("cli").ssl_context(server=False)
        link = await LinkConnection.open("127.0.0.1", server.port, BOUND, 2.0, client)
        assert refused(await link.send(send_of("bad1"))) == ["bad1"] and node.callers == ["cli"]
        assert node_id_of(link.peercert()) == "srv"  # the server proved who it is
        link.close()
        await server.stop()

    asyncio.run(go())


def test_no_link_without_the_clusters_leaf_on_both_ends():
    async def go():
        server, node = LinkServer("127.0.0.1", 0, BOUND, tls=KEY.tls("srv")), Node()
        await server.start(node)
        strangers = [
            ClusterKey(generate_secret()).tls("cli").ssl_context(server=False),  # another key's leaf
            None,  # no TLS at all
        ]
        for context in strangers:
            with pytest.raises((OSError, StreamBroken, TimeoutError)):
                async with asyncio.timeout(3):
                    await LinkConnection.open("127.0.0.1", server.port, BOUND, 2.0, context)
        other = LinkServer("127.0.0.1", 0, BOUND, tls=ClusterKey(generate_secret()).tls("srv"))
        await other.start(Node())
        with pytest.raises(ssl.SSLError, match="CERTIFICATE_VERIFY_FAILED"):  # nor to an impostor's server
            await LinkConnection.open("127.0.0.1", other.port, BOUND, 2.0, KEY.tls("cli").ssl_context(server=False))
        assert node.arrived == []
        await server.stop()
        await other.stop()

    asyncio.run(go())


def test_a_handshake_left_unfinished_ends_the_connection_after_the_stall_time_however_it_trickles():
    """The server runs each connection's TLS itself (tls_session.py): a peer that opens a connection and says
    nothing, or sends its hello a byte at a time, is cut off `stall_s` after it connected; a plaintext greeting
    gets not one byte of the protocol back."""

    async def trickle(port: int) -> float:
        began = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        hello = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32)  # a ClientHello's first bytes
        try:
            for b in hello:
                writer.write(bytes([b]))
                await asyncio.sleep(0.05)
                if reader.at_eof():
                    break
            async with asyncio.timeout(3):
                while await reader.read(1 << 16):
                    pass
        finally:
            writer.close()
        return time.monotonic() - began

    async def go():
        server, node = LinkServer("127.0.0.1", 0, BOUND, stall_s=0.4, tls=KEY.tls("srv")), Node()
        await server.start(node)
        began = time.monotonic()
        assert await raw(server.port, b"", wait=3.0) == b""  # silent: closed, nothing said
        assert 0.3 < time.monotonic() - began < 2.5
        assert 0.3 < await trickle(server.port) < 1.5  # not kept open by each byte
        assert await raw(server.port, GREETING) == b""  # no TLS: nothing of the link comes back
        assert node.arrived == [] and node.callers == []
        await server.stop()

    asyncio.run(go())


def test_a_renewed_leaf_serves_the_handshakes_after_it_and_replaces_idle_links():
    async def go():
        now = [dt.datetime.now(dt.UTC) - dt.timedelta(hours=3)]  # so both leaves, old and new, are valid now
        srv = NodeTls(KEY.ca(), "srv", lifetime=dt.timedelta(hours=4), clock=lambda: now[0])
        cli = NodeTls(KEY.ca(), "cli", lifetime=dt.timedelta(hours=4), clock=lambda: now[0])
        server = LinkServer("127.0.0.1", 0, BOUND, tls=srv)
        await server.start(Node())
        links = PeerLinks(BOUND, timeout=2.0, tls=cli)
        links.learn("127.0.0.1:7", server.port)

        async def link_up() -> LinkConnection:
            for _ in range(300):
                if (link := links.get("127.0.0.1:7")) is not None:
                    return link
                await asyncio.sleep(0.01)
            raise AssertionError("no link")

        first = await link_up()
        served = first.peercert()["serialNumber"]
        now[0] += dt.timedelta(hours=2, minutes=1)  # past both leaves' half-life: renewed at their next use
        second = await link_up()
        assert first.closed and second is not first  # made again, with the client's new leaf
        assert second.peercert()["serialNumber"] != served  # the server's new leaf
        assert refused(await second.send(send_of("bad2"))) == ["bad2"]
        await links.close()
        await server.stop()

    asyncio.run(go())


def test_the_transport_has_links_with_a_key_where_ssl_takes_the_leaf_from_memory():
    assert (GrpcTransport(BOUND, tls=KEY.tls("n")).links is not None) == LEAF_IN_MEMORY
    assert GrpcTransport(BOUND, links=False).links is None
