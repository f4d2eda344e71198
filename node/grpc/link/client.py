"""The data links to peers (node/grpc/link/server.py says why): one connection per peer, made in the background
once the peer's health check names its link port, used by the transport once it is up, never waited for.

Until a link is up, and for a while after it failed (`PeerLinks`: doubling from `retry_s` to `max_retry_s`, back
to `retry_s` once a link lived `healthy_s`), the gRPC stream carries the messages: a link that can't be had costs
nothing but the attempts. A message in flight on a link that breaks fails as on a broken gRPC stream (StreamBroken:
it may have arrived, so it is never sent again on the other path).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from discovery.address import parse_address
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.link.frames import DATA, ERROR, GREETING, PACKED, FrameError, FrameReader, frame
from node.grpc.link.tls_session import TlsSession
from node.grpc.stream import StreamBroken
from node.security.peer import SERVER_NAME

if TYPE_CHECKING:  # node.security.tls loads cryptography: only a node with a cluster key needs it
    from node.security.tls import NodeIdentity, NodeTls

log = logging.getLogger(__name__)


class LinkConnection(asyncio.Protocol):
    """One connected link: `send` writes a message and returns its answer, which comes within `timeout` or ends the
    link. Answers come in the order the messages went (the n-th answer is the n-th waiter's); any failure ends the
    link and fails every message waiting on it."""

    def __init__(self, max_message_bytes: int, timeout: float, context: ssl.SSLContext | None = None):
        self.frames, self.timeout = FrameReader(max_message_bytes), timeout
        # with a cluster key, the TLS the link's writers seal their bytes with, under `lock` (tls_session.py)
        self.session = TlsSession(context, SERVER_NAME) if context is not None else None
        self.waiting: deque[asyncio.Future] = deque()
        self.greeting = b""  # what came of the server's greeting; None once it was right
        self.greeted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.greeted.add_done_callback(lambda f: f.cancelled() or f.exception())  # (its failure is `open`'s to say)
        self.writable: asyncio.Future[None] | None = None  # while the socket's buffer is full
        self.closed = False
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.lock = threading.Lock()  # every write: the loop's (`post`) and another thread's (`write_now`)
        self.direct: socket.socket | None = None  # the socket for `write_now`; ours to close
        self.handshaken: asyncio.Future[None] = self.loop.create_future()  # (at once without TLS)
        self.handshaken.add_done_callback(lambda f: f.cancelled() or f.exception())  # (`open`'s to say)
        if self.session is None:
            self.handshaken.set_result(None)
        self.rest = b""  # what a `write_now` could not write at once, which the loop writes before anything else

    @classmethod
    async def open(
        cls, host: str, port: int, max_message_bytes: int, timeout: float, context: ssl.SSLContext | None = None
    ) -> LinkConnection:
        """Connected (through mutual TLS with `context`: node/security/tls.py's `ssl_context`) and greeted; raises
        OSError (ssl.SSLError for a peer without the cluster's leaf), TimeoutError or StreamBroken; the caller
        bounds the time."""
        _, link = await asyncio.get_running_loop().create_connection(
            lambda: cls(max_message_bytes, timeout, context), host, port
        )
        try:
            await link.handshaken
            with link.lock:
                link.transport.write(link._sealed(GREETING))
            await link.greeted
        except BaseException:
            link.close()
            raise
        return link

    async def send(
        self, request: pb.SendRequest | bytes, on_write: Callable[[], None] | None = None
    ) -> pb.SendResponse:
        return await self.post(request, on_write)

    def post(
        self, request: pb.SendRequest | bytes, on_write: Callable[[], None] | None = None
    ) -> Awaitable[pb.SendResponse]:
        """`send`'s write, now (StreamBroken once the link is closed), and its answer to await; `request`: a
        SendRequest, or the bytes of the same message packed (node/grpc/link/packed.py)."""
        if self.closed:
            raise StreamBroken(grpc.StatusCode.UNAVAILABLE, "the link is closed")
        data = frame(PACKED, request) if isinstance(request, bytes) else frame(DATA, request.SerializeToString())
        answer = self.loop.create_future()
        with self.lock:
            self.waiting.append(answer)
            if on_write is not None:
                on_write()
            self._flush_rest()
            self.transport.write(self._sealed(data))
        return self._answer(answer)

    def write_now(self, payload: bytes) -> asyncio.Future[pb.SendResponse] | None:
        """From any thread (the engine thread, as a pass ends: node/runtime/early_send.py): the packed message
        written to the socket now (sealed first under TLS), and the future its answer comes to (`answer` awaits it
        on the loop); None where it can't be without the loop (a closed link, bytes of the loop's still unwritten, a
        full socket): nothing was written then. Messages keep their order with the loop's: every write holds
        `lock`, and what the socket did not take at once the loop writes before anything else (under TLS all of a
        sealed message, which the session counted: it goes, written now or by the loop)."""
        with self.lock:
            if self.closed or self.direct is None or self.rest or self.transport.get_write_buffer_size():
                return None
            answer = self.loop.create_future()  # (only made here: set and awaited on the loop)
            answer.add_done_callback(lambda f: f.cancelled() or f.exception())  # (its pass may never reach the loop)
            self.waiting.append(answer)
            data = self._sealed(frame(PACKED, payload))
            try:
                sent = self.direct.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:  # broken: the loop finds out and fails what waits
                sent = 0
            if sent == 0 and self.session is None:
                self.waiting.pop()
                return None
            if sent < len(data):
                self.rest = data[sent:]
                self.loop.call_soon_threadsafe(self._write_rest)
        return answer

    def peercert(self) -> dict | None:
        """The server's leaf under TLS, once the handshake checked it (None without TLS)."""
        with self.lock:
            return self.session.peercert() if self.session is not None else None

    def _sealed(self, data: bytes) -> bytes:
        """(Under `lock`.) `data` as the link's bytes: TLS records with a cluster key."""
        return data if self.session is None else self.session.seal(data)

    def _write_rest(self) -> None:
        with self.lock:
            self._flush_rest()

    def _flush_rest(self) -> None:
        """(Under `lock`, on the loop.)"""
        if self.rest and not self.closed:
            self.transport.write(self.rest)
        self.rest = b""

    def answer(self, answer: asyncio.Future[pb.SendResponse]) -> Awaitable[pb.SendResponse]:
        """On the loop: a `write_now` message's answer, within the link's deadline."""
        return self._answer(answer)

    async def _answer(self, answer: asyncio.Future) -> pb.SendResponse:
        overdue = asyncio.get_running_loop().call_later(self.timeout, self._overdue, answer)
        try:
            if self.writable is not None:  # the peer reads slower than we write: wait for room, within the deadline
                await asyncio.shield(self.writable)
            return await answer
        finally:
            overdue.cancel()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        keep_alive(sock)
        self.direct = socket.socket(fileno=os.dup(sock.fileno()))
        self.direct.setblocking(False)
        if self.session is not None:  # the client's hello
            self.data_received(b"")

    def _opened(self, data: bytes) -> bytes:
        """(Under `lock`, on the loop.) What came off the socket, through the TLS session: the plaintext (b"" while
        the handshake runs), its own messages written. ssl.SSLError for a refused peer or a broken stream,
        ConnectionResetError once the peer ended the session."""
        session = self.session
        session.feed(data)
        if not session.done and session.handshake() and not self.handshaken.done():
            self.handshaken.set_result(None)
        plain = session.read() if session.done else b""
        if owed := session.owed():
            self._flush_rest()
            self.transport.write(owed)
        return plain

    def data_received(self, data: bytes) -> None:
        if self.session is not None:
            try:
                with self.lock:
                    data = self._opened(data)
            except (ssl.SSLError, ConnectionResetError) as e:
                if not self.handshaken.done():  # (both are OSErrors, as a refused connection is)
                    self.handshaken.set_exception(e)
                self._end(StreamBroken(grpc.StatusCode.UNAVAILABLE, f"the link's TLS: {e}"))
                return
            if not data:
                return
        if self.greeting is not None:
            self.greeting += data
            if not GREETING.startswith(self.greeting[: len(GREETING)]):
                self._end(StreamBroken(grpc.StatusCode.UNAVAILABLE, "the peer does not speak this link's version"))
                return
            if len(self.greeting) < len(GREETING):
                return
            data, self.greeting = self.greeting[len(GREETING) :], None
            if not self.greeted.done():
                self.greeted.set_result(None)
        try:
            for kind, payload in self.frames.feed(data):
                if kind == ERROR:  # the peer refused the message at the head, and closes
                    raise _refusal(payload)
                if kind != DATA:
                    raise StreamBroken(grpc.StatusCode.UNKNOWN, f"the peer answered with a frame of kind {kind}")
                if not self.waiting:
                    raise StreamBroken(grpc.StatusCode.UNKNOWN, "the peer answered a message never sent")
                waiter = self.waiting.popleft()
                try:
                    answer = pb.SendResponse.FromString(payload)
                except DecodeError:
                    raise StreamBroken(grpc.StatusCode.UNKNOWN, "the peer's answer is not a SendResponse") from None
                if not waiter.done():  # (its sender may have given up)
                    waiter.set_result(answer)
        except FrameError as e:
            self._end(StreamBroken(grpc.StatusCode.UNKNOWN, f"the peer's frames are malformed: {e}"))
        except StreamBroken as e:
            self._end(e)

    def pause_writing(self) -> None:
        self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        writable, self.writable = self.writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(StreamBroken(grpc.StatusCode.UNAVAILABLE, "the peer closed the link"))

    def _overdue(self, answer: asyncio.Future) -> None:
        if not answer.done():  # fails this answer and every one behind it: the link is suspect
            self._end(StreamBroken(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self.timeout:g}s"))

    def _end(self, error: StreamBroken) -> None:
        with self.lock:
            self.closed = True
            if self.direct is not None:
                self.direct.close()
                self.direct = None
        if not self.handshaken.done():
            self.handshaken.set_exception(error)
        if not self.greeted.done():
            self.greeted.set_exception(error)
        self.resume_writing()  # a sender waiting for room finds its answer failed below
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_exception(error)
        if self.transport is not None:
            self.transport.close()

    def close(self) -> None:
        self._end(StreamBroken(grpc.StatusCode.CANCELLED, "the link was closed"))


def keep_alive(sock: socket.socket, idle_s: int = 20, interval_s: int = 5, probes: int = 2) -> None:
    """TCP keepalive probes on an idle link (gRPC's channels ping on the same schedule): a peer that vanished
    without closing it (power loss, a cut cable) ends the link within a minute, not at the next message's
    deadline."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPALIVE", idle_s), ("TCP_KEEPINTVL", interval_s)):
        if hasattr(socket, name):  # Linux names the first TCP_KEEPIDLE, macOS TCP_KEEPALIVE
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if hasattr(socket, "TCP_KEEPCNT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)


def _refusal(payload: bytes) -> StreamBroken:
    """An ERROR frame's "CODE detail" as the gRPC stream would have ended with it."""
    name, _, detail = payload.decode("utf-8", "replace").partition(" ")
    code = grpc.StatusCode.__members__.get(name, grpc.StatusCode.UNKNOWN)
    return StreamBroken(code, detail[:512])


class PeerLinks:
    """The links to peers, by their gRPC address; with `tls` (a cluster key) each is mutual TLS, and one made with
    a leaf since renewed is made again once no message waits on it (as gRPC's channels are rebuilt)."""

    def __init__(
        self,
        max_message_bytes: int,
        timeout: float,
        connect_s: float = 2.0,
        retry_s: float = 1.0,
        max_retry_s: float = 300.0,
        healthy_s: float = 60.0,
        tls: NodeTls | None = None,
    ):
        self.max_message_bytes, self.timeout, self.connect_s = max_message_bytes, timeout, connect_s
        self.retry_s, self.max_retry_s, self.healthy_s = retry_s, max_retry_s, healthy_s
        self.tls = tls
        self._context: tuple[NodeIdentity, ssl.SSLContext] | None = None  # the client context, for its leaf
        self.ports: dict[str, int] = {}  # the link port each peer's latest health check named
        self.links: dict[str, tuple[LinkConnection, float, object]] = {}  # up: since when, with which leaf
        self.connecting: dict[str, asyncio.Task] = {}
        self.backoff: dict[str, tuple[float, float]] = {}  # (no attempt before, the wait after the next failure)

    def learn(self, address: str, port: int) -> None:
        """`address`'s health check named `port` (0: it has no link): a change drops what there was."""
        if self.ports.get(address, 0) == port:
            return
        self._drop(address)
        if port:
            self.ports[address] = port

    def get(self, address: str) -> LinkConnection | None:
        """The link to `address` if it is up; else None, and an attempt to make one starts when one may."""
        up = self.links.get(address)
        if up is not None:
            link, since, leaf = up
            if not link.closed and (leaf is self._leaf() or link.waiting):
                return link
            del self.links[address]
            if link.closed:
                lived = time.monotonic() - since
                self._failed(address, f"broke after {lived:.0f}s", reset=lived >= self.healthy_s)
            else:  # made with a leaf since renewed, and idle: made again with the current one
                link.close()
        port = self.ports.get(address)
        if port and address not in self.connecting and time.monotonic() >= self.backoff.get(address, (0.0,))[0]:
            self.connecting[address] = asyncio.ensure_future(self._connect(address, port))
        return None

    async def _connect(self, address: str, port: int) -> None:
        try:
            host, _ = parse_address(address)
            leaf, context = self._leaf(), self._client_context()
            async with asyncio.timeout(self.connect_s):
                link = await LinkConnection.open(host, port, self.max_message_bytes, self.timeout, context)
        except (OSError, TimeoutError, ValueError, StreamBroken) as e:  # (ssl.SSLError is an OSError)
            self._failed(address, f"{type(e).__name__}: {e}")
            return
        finally:
            if self.connecting.get(address) is asyncio.current_task():  # (a cancelled one may have a successor)
                del self.connecting[address]
        if self.ports.get(address) != port:  # forgotten or moved meanwhile
            link.close()
            return
        self.links[address] = (link, time.monotonic(), leaf)

    def _leaf(self) -> object:
        return self.tls.identity() if self.tls is not None else None

    def _client_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        identity = self.tls.identity()
        if self._context is None or self._context[0] is not identity:
            self._context = (identity, self.tls.ssl_context(server=False, identity=identity))
        return self._context[1]

    def _failed(self, address: str, why: str, reset: bool = False) -> None:
        wait = self.retry_s if reset else self.backoff.get(address, (0.0, self.retry_s))[1]
        self.backoff[address] = (time.monotonic() + wait, min(wait * 2, self.max_retry_s))
        log.info("data link to %s: %s; the gRPC stream carries its messages, next try in %gs", address, why, wait)

    def _drop(self, address: str) -> None:
        self.ports.pop(address, None)
        self.backoff.pop(address, None)
        link, *_ = self.links.pop(address, (None,))
        if link is not None:
            link.close()
        task = self.connecting.pop(address, None)
        if task is not None:
            task.cancel()

    async def forget(self, address: str) -> None:
        task = self.connecting.get(address)
        self._drop(address)
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        for address in {*self.ports, *self.links, *self.connecting}:
            await self.forget(address)
