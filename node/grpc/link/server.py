"""The data link's listener: the data path's messages (activations, token messages) over TCP frames, for peers
that would otherwise send them on the gRPC stream (node/grpc/stream.py).

Why: a message on gRPC's Python stream pays HTTP/2's framing and gRPC's core thread with its hand-offs into asyncio
(docs/benchmarks.md has the figures), and a ring pays that on every hop of every token; a frame on a bare socket
pays neither. The link carries the very messages of that stream (node/grpc/wire.py's codec, validated by the same
`take_send`; a decode step's packed in a fixed layout that decodes to the same values under the same checks:
node/grpc/link/packed.py), answered in order.

With a cluster key the link is the same mutual TLS as gRPC's (node/security/tls.py's `ssl_context`: TLS 1.3, the
peer's leaf required and checked against the cluster CA before any byte of the protocol, the caller named from
it), the leaf renewed for the handshakes after a renewal; where Python's ssl can't take the leaf from memory
(`LEAF_IN_MEMORY`) there is no link with a key. Without one the link is plaintext and open to whoever reaches it,
as the gRPC port is.

Bad input closes the connection after an ERROR frame naming it (the sender then fails those messages as a broken
gRPC stream would); nothing a peer sends reaches the node unvalidated, and a frame's bound is the model's, as on
gRPC. A greeting or frame left half-sent for `stall_s` closes the connection; a peer that doesn't read its answers
stops being read.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from node.core.requests import Activation, Refusal
from node.grpc import wire
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.link import packed
from node.grpc.link.frames import DATA, ERROR, GREETING, PACKED, FrameError, FrameReader, frame
from node.grpc.link.tls_session import TlsSession
from node.grpc.server import Handler, accept_send, take_send
from node.security.peer import node_id_of

if TYPE_CHECKING:  # node.security.tls loads cryptography: only a node with a cluster key needs it
    from node.security.tls import NodeTls

log = logging.getLogger(__name__)


class LinkServer:
    """Bound at construction (its port goes in the node's health-check answers), serving once `start` hands it the
    node; `port` 0 binds a free one."""

    def __init__(self, host: str, port: int, max_message_bytes: int, stall_s: float = 10.0, tls: NodeTls | None = None):
        self.tls = tls
        self.served = tls.identity() if tls else None  # the leaf the context holds
        self.context = tls.ssl_context(server=True, identity=self.served) if tls else None
        try:
            self.sock = socket.create_server((host, port), family=_family(host))
        except OSError as e:
            raise OSError(f"cannot listen for the data link on {host}:{port}: {e.strerror or e}") from None
        self.port = self.sock.getsockname()[1]
        self.max_message_bytes, self.stall_s = max_message_bytes, stall_s
        self.server: asyncio.Server | None = None
        self.connections: set[_Connection] = set()
        # a status source (the node's counters); link_packed: those of the messages that came packed; link_rows: the
        # decode rows' inputs of those, handed to the engine thread the short way (node/runtime/relay.py)
        # link_warmed: the times `warm` ran the short way on a connection's last row
        self.counters = {"link_messages": 0, "link_packed": 0, "link_rows": 0, "link_refused": 0, "link_warmed": 0}
        self.node: Handler | None = None

    async def start(self, node: Handler) -> None:
        self.node = node
        node.warm_with(self.warm)
        loop = asyncio.get_running_loop()
        # plain TCP: with a key each connection runs its own TLS session (tls_session.py), the handshake within stall_s
        self.server = await loop.create_server(lambda: _Connection(self, node), sock=self.sock)

    def warm(self) -> None:
        """The short way's decoding and the core's checks run on each connection's last row taken that way, taking
        nothing (`RequestBook.would_relay`): the node calls this while it waits for its ring (node/runtime/pipeline.py
        `_warm`), so that their code and data are in its core's cache when the next row comes. Why: the pass that
        ran since has streamed the model's weights through that cache, and every step of the take costs more cold,
        on the ring's every hop (docs/benchmarks.md)."""
        for connection in self.connections:
            if (last := connection.last_row) is None:
                continue
            row = packed.unpack_row(last, self.node.max_tensor_bytes)
            if row is not None and self.node.would_relay(row[0], row[1], connection.caller):
                self.counters["link_warmed"] += 1

    def renewed(self) -> None:
        """A connection is coming: its handshake shows the current leaf (renewed at half-life: tls.py)."""
        if self.tls is not None and (current := self.tls.identity()) is not self.served:
            self.tls.load_leaf(self.context, current)
            self.served = current

    async def stop(self) -> None:
        if self.server is None:
            self.sock.close()
            return
        self.server.close()
        for connection in list(self.connections):
            connection.transport.close()
        await self.server.wait_closed()


_ANSWERED = frame(DATA, pb.SendResponse().SerializeToString())  # nothing refused: the usual answer


def _answer(refused: list[Refusal]) -> bytes:
    return frame(DATA, pb.SendResponse(rejected=[wire.encode_refusal(r) for r in refused]).SerializeToString())


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class _Connection(asyncio.Protocol):
    def __init__(self, server: LinkServer, node: Handler):
        server.renewed()
        self.server, self.node = server, node
        self.caller: str | None = None  # the peer's node id, from its verified leaf (with a key)
        self.reader = FrameReader(server.max_message_bytes)
        self.greeting = b""  # what arrived of the client's greeting; None once it was right
        self.outgoing: list[bytes] = []
        self.flush: asyncio.Handle | None = None
        self.stall: asyncio.TimerHandle | None = None
        self.last_row: bytes | None = None  # the last message the short way took (`LinkServer.warm`)
        # with a key, the connection's TLS (the context asks for the peer's leaf and checks it in the handshake)
        self.session = TlsSession(server.context, None, server_side=True) if server.context is not None else None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.server.connections.add(self)  # (asyncio sets TCP_NODELAY on its TCP transports)
        self._watch(True)  # the handshake and the greeting come within stall_s, or the connection ends

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._watch(False)
        if self.flush is not None:
            self.flush.cancel()

    def pause_writing(self) -> None:  # a peer that doesn't read its answers sends no more
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.session is not None:
            try:
                data = self._opened(data)
            except (ssl.SSLError, ConnectionResetError) as e:  # a peer without the cluster's leaf, a broken stream
                if not self.session.done:
                    log.warning("data link from %s: TLS refused: %s", self.transport.get_extra_info("peername"), e)
                self.transport.close()
                return
            if not data:
                return
        if self.greeting is not None:
            self.greeting += data
            if not GREETING.startswith(self.greeting[: len(GREETING)]):
                self.transport.close()  # not this protocol (or not its version): no frame for it
                return
            if len(self.greeting) < len(GREETING):
                return
            data, self.greeting = self.greeting[len(GREETING) :], None
            self._write(GREETING)
        try:
            frames = self.reader.feed(data)
        except FrameError as e:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        for kind, payload in frames:
            if not self._take(kind, payload, time.perf_counter()):
                return
        self._watch(self.reader.pending > 0)

    def _take(self, kind: int, payload: bytes, received: float) -> bool:
        if kind not in (DATA, PACKED):
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, "a client sends data or packed frames only")
            return False
        try:
            if kind == PACKED:
                row = packed.unpack_row(payload, self.node.max_tensor_bytes)  # a decode row's input, the usual
                if row is not None and self.node.relay_row(row[0], row[1], self.caller, received):
                    self.server.counters["link_rows"] += 1
                    self.last_row = payload
                    refused = accept_send(self.node, [], row[2], self.caller, received)  # (its tokens, if any)
                else:
                    activations, messages = (
                        ([Activation(row[0], row[1])], row[2])
                        if row is not None
                        else packed.unpack(payload, self.node.max_tensor_bytes)
                    )
                    refused = accept_send(self.node, activations, messages, self.caller, received)
                answer = _ANSWERED if not refused else _answer(refused)
                fed = row is not None or bool(activations)
            else:
                reply, fed = take_send(self.node, pb.SendRequest.FromString(payload), self.caller, received)
                answer = frame(DATA, reply.SerializeToString())
        except (DecodeError, wire.WireError) as e:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, str(e) or "not a SendRequest")
            return False
        except Exception:  # a bug: the peer hears of it as gRPC's own handler errors
            log.exception("the data link's message failed")
            self._refuse(grpc.StatusCode.UNKNOWN, "internal error")
            return False
        self.server.counters["link_messages"] += 1
        self.server.counters["link_packed"] += kind == PACKED
        self.outgoing.append(answer)
        if fed and self.flush is None:  # the worker first: the pass this feeds starts before the answer goes
            self.flush = asyncio.get_running_loop().call_soon(self._flush)
        elif self.flush is None:  # (behind a deferred answer, an answer waits with it: answers go in order)
            self._flush()
        return True

    def _opened(self, data: bytes) -> bytes:
        """What came off the socket, through the TLS session: the plaintext (b"" while the handshake runs), the
        session's own messages written, the caller named from its verified leaf once the handshake ends.
        ssl.SSLError for a refused peer or a broken stream, ConnectionResetError once the peer ended the session."""
        session = self.session
        session.feed(data)
        if not session.done and session.handshake():
            self.caller = node_id_of(session.peercert())
        plain = session.read() if session.done else b""
        if owed := session.owed():
            self.transport.write(owed)
        return plain

    def _write(self, data: bytes) -> None:
        self.transport.write(data if self.session is None else self.session.seal(data))

    def _flush(self) -> None:
        self.flush = None
        if not self.transport.is_closing():
            self._write(b"".join(self.outgoing))
        self.outgoing = []

    def _refuse(self, code: grpc.StatusCode, why: str) -> None:
        """The ERROR frame (behind the answers owed), then the end of the connection."""
        log.warning("data link from %s: %s", self.transport.get_extra_info("peername"), why)
        self.server.counters["link_refused"] += 1
        if self.flush is not None:
            self.flush.cancel()
        self.outgoing.append(frame(ERROR, f"{code.name} {why}".encode()[:4096]))
        self._flush()
        self.transport.close()

    def _watch(self, waiting: bool) -> None:
        """While a greeting or frame is half here, a timer that ends the connection if the rest doesn't come."""
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None
        if waiting and not self.transport.is_closing():
            self.stall = asyncio.get_running_loop().call_later(self.server.stall_s, self._stalled)

    def _stalled(self) -> None:
        log.warning(
            "data link from %s: half a message for %gs", self.transport.get_extra_info("peername"), self.server.stall_s
        )
        self.transport.close()
