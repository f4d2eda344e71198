"""The gRPC client side of the transport: one channel per peer, explicit message size limits, a deadline on every
call, and gRPC's errors turned into `TransportError`s."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
import numpy as np

from node.core.failures import Failure, FailureKind
from node.core.plan import RequestSpec
from node.core.requests import Activation, Refusal, TokenMessage
from node.core.topology import NodeInfo
from node.fetch.manifest import Manifest, piece_deadline
from node.grpc import wire, wire_cluster
from node.grpc.failures import failure_of
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.generated import node_service_pb2_grpc as pb_grpc
from node.grpc.link import packed
from node.grpc.link.client import PeerLinks
from node.grpc.stream import PeerStream, StreamBroken
from node.runtime.transport import TransportError

if TYPE_CHECKING:  # node.security.tls loads cryptography: only a node with a cluster key needs it
    from node.security.tls import NodeIdentity, NodeTls

# Activations of a long prompt can be large (tokens x hidden x 4 bytes); grpc's default cap is 4 MiB.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def message_bound(hidden_size: int, context: int) -> int:
    """The largest message a node serving a model needs to take, read whole by gRPC before any handler sees it:
    one request's whole context of activations (context x hidden x 4 bytes, float32) and 1 MiB for the rest, at
    least gRPC's default of 4 MiB. Senders cut their calls to fit (node/runtime/outbox.py), so a larger message
    is a hostile one; a bound from the model keeps what a peer can make a node hold (and parse on its event loop)
    to what the model implies, not 256 MiB a message."""
    return max(4 << 20, context * hidden_size * 4 + (1 << 20))


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # A peer that is starting (or restarting) is retried within 0.1-1 s, not after gRPC's default backoff of up
        # to two minutes: with wait_for_ready, calls made meanwhile wait for the connection instead of failing.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        # Pings find a connection whose peer vanished without closing it (power loss, a cut cable).
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return channel_options(max_message_bytes) + [
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),  # below the clients' keepalive: no GOAWAY
        ("grpc.max_connection_idle_ms", 300_000),  # connections of peers that left are closed
        # Certificates are checked at handshakes only: no connection outlives its peer's leaf by much.
        ("grpc.max_connection_age_ms", 3_600_000),
        ("grpc.max_connection_age_grace_ms", 60_000),
        ("grpc.max_concurrent_streams", 256),  # per connection
    ]


def links_with(tls: NodeTls | None) -> bool:
    """Whether a node with `tls` (None: no cluster key) can have data links: always without a key; with one where
    Python's ssl can take the leaf from memory (node/security/tls.py's LEAF_IN_MEMORY)."""
    if tls is None:
        return True
    from node.security.tls import LEAF_IN_MEMORY

    return LEAF_IN_MEMORY


def _translated(call):
    """Turn a gRPC error of the wrapped call into a TransportError naming the peer."""

    @functools.wraps(call)
    async def wrapper(self: GrpcTransport, address: str, *args, **kwargs):
        try:
            return await call(self, address, *args, **kwargs)
        except grpc.aio.AioRpcError as e:
            raise TransportError(*failure_of(e.code(), e.details() or "", address)) from None
        except wire.WireError as e:
            raise TransportError(
                Failure(FailureKind.ERROR, f"answered with a malformed message: {e}", address), "malformed"
            ) from None
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # we are being cancelled: not the call's doing
            # grpc.aio raises CancelledError in calls whose channel was closed meanwhile (a peer that left)
            raise TransportError(Failure(FailureKind.LOST, "the channel was closed", address), "unavailable") from None

    return wrapper


class GrpcTransport:
    """The `Transport` over gRPC. Calls on a request's data path wait for a connection that is not up yet
    (`wait_for_ready`: a peer still starting, a reconnect in progress) but never longer than `rpc_timeout`; a peer
    that is down for longer is noticed by membership's health checks, which fail fast."""

    def __init__(
        self,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        rpc_timeout: float = 10.0,
        tls: NodeTls | None = None,
        links: bool = True,
    ):
        """With `tls` (a cluster key), every channel is mutual TLS: both ends prove they hold the key. `links`: the
        data path goes on a peer's data link (node/grpc/link/) where its health check names one and it is up (with
        `tls`, mutual TLS as well, where `links_with` says the link can have it)."""
        self.max_message_bytes, self.rpc_timeout, self.tls = max_message_bytes, rpc_timeout, tls
        self.links = PeerLinks(max_message_bytes, rpc_timeout, tls=tls) if links and links_with(tls) else None
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.streams: dict[str, tuple[pb_grpc.NodeServiceStub, PeerStream]] = {}  # the data path to each peer
        self._stubs: dict[str, tuple[pb_grpc.NodeServiceStub, NodeIdentity | None]] = {}

    def stub(self, address: str) -> pb_grpc.NodeServiceStub:
        identity = self.tls.identity() if self.tls else None  # renewed at half-life
        stub, built_with = self._stubs.get(address, (None, None))
        if stub is not None and built_with is not identity:
            # A channel keeps the certificate it was made with: new calls get one with the renewed leaf, calls in
            # flight finish on the old channel, which is closed once their deadline has passed.
            old = self.channels.pop(address)
            asyncio.get_running_loop().call_later(self.rpc_timeout, lambda: asyncio.ensure_future(old.close()))
            stub = None
        if stub is None:
            options = channel_options(self.max_message_bytes)
            if identity is None:
                channel = grpc.aio.insecure_channel(address, options=options)
            else:
                channel = grpc.aio.secure_channel(
                    address, self.tls.channel_credentials(identity), options=options + self.tls.channel_options()
                )
            self.channels[address] = channel
            stub = pb_grpc.NodeServiceStub(channel)
            self._stubs[address] = (stub, identity)
        return stub

    @_translated
    async def send_prompt(self, address: str, spec: RequestSpec, tokens: np.ndarray) -> None:
        request = pb.SendPromptRequest(spec=wire.encode_spec(spec), tokens=wire.encode_tensor(tokens))
        await self.stub(address).SendPrompt(request, timeout=self.rpc_timeout, wait_for_ready=True)

    @_translated
    async def send(
        self,
        address: str,
        activations: tuple[Activation, ...],
        messages: tuple[TokenMessage, ...],
        *,
        on_write: Callable[[], None] | None = None,
    ) -> list[Refusal]:
        stub = self.stub(address)  # first: it may replace a channel whose certificate was renewed
        if (answer := self.post(address, activations, messages, on_write=on_write)) is not None:
            return await answer
        on, stream = self.streams.get(address, (None, None))
        if on is not stub:  # a new channel gets its own stream
            if stream is not None:
                asyncio.ensure_future(stream.close())
            stream = PeerStream(lambda: stub.SendStream(wait_for_ready=True), self.rpc_timeout)
            self.streams[address] = (stub, stream)
        try:
            response = await stream.send(wire.encode_send(activations, messages), on_write)
        except StreamBroken as e:
            raise TransportError(*failure_of(e.code, e.details, address)) from None
        return [wire.decode_refusal(r) for r in response.rejected]

    def post(
        self,
        address: str,
        activations: tuple[Activation, ...],
        messages: tuple[TokenMessage, ...],
        *,
        on_write: Callable[[], None] | None = None,
    ) -> Awaitable[list[Refusal]] | None:
        """`send`'s message written now, on the peer's data link, where one is up and nothing is in flight on the
        gRPC stream to it (the peer gets messages in order), with its answer to await; None: `send` carries it on
        the stream."""
        _, stream = self.streams.get(address, (None, None))
        if self.links is None or (stream and stream.waiting) or (link := self.links.get(address)) is None:
            return None
        try:
            message = packed.pack(activations, messages)  # (None: the SendRequest)
            answer = link.post(wire.encode_send(activations, messages) if message is None else message, on_write)
        except StreamBroken:  # closed under us: `send` finds another way
            return None
        return self._answered(address, answer)

    def write_now(
        self, address: str, activations: tuple[Activation, ...], messages: tuple[TokenMessage, ...] = ()
    ) -> Callable[[], Awaitable[list[Refusal]]] | None:
        """From the engine thread: `activations` and `messages` (packable: no spec, no failure) written to `address`'s data link now, and what
        gives, on the loop, `send`'s answer to await; None: nothing was written (no link up, a message in
        flight on the gRPC stream, or `LinkConnection.write_now` could not). Only dict reads here: the loop owns
        the maps."""
        _, stream = self.streams.get(address, (None, None))
        up = self.links.links.get(address) if self.links is not None else None
        if up is None or (stream and stream.waiting) or (message := packed.pack(activations, messages)) is None:
            return None
        link = up[0]
        if (waiter := link.write_now(message)) is None:
            return None
        return lambda: self._answered(address, link.answer(waiter))

    @_translated
    async def _answered(self, address: str, answer: Awaitable[pb.SendResponse]) -> list[Refusal]:
        try:
            response = await answer
        except StreamBroken as e:
            raise TransportError(*failure_of(e.code, e.details, address)) from None
        return [wire.decode_refusal(r) for r in response.rejected]

    @_translated
    async def end_request(
        self, address: str, request_id: str, reason: str, branch: tuple[str, int] | None = None
    ) -> None:
        request = pb.EndRequestRequest(request_id=request_id, reason=reason)
        if branch is not None:
            request.branch_of, request.branch_at = branch
        await self.stub(address).EndRequest(request, timeout=self.rpc_timeout, wait_for_ready=True)

    @_translated
    async def health_check(self, address: str, timeout: float = 2.0) -> NodeInfo:
        response = await self.stub(address).HealthCheck(pb.HealthCheckRequest(), timeout=timeout)
        if not response.ok:
            raise TransportError(Failure(FailureKind.LOST, "says it is not ready", address), "unavailable")
        info = wire_cluster.decode_node_info(response.node)
        if self.links is not None:
            self.links.learn(address, info.link_port)
        return info

    @_translated
    async def leave(self, address: str, node_id: str, timeout: float = 1.0) -> None:
        await self.stub(address).Leave(pb.LeaveRequest(node_id=node_id), timeout=timeout)

    @_translated
    async def manifest(self, address: str, model_id: str, timeout: float = 30.0) -> Manifest:
        response = await self.stub(address).GetManifest(pb.ManifestRequest(model_id=model_id), timeout=timeout)
        return wire_cluster.decode_manifest(response)

    @_translated
    async def fetch_piece(
        self,
        address: str,
        model_id: str,
        index: int,
        length: int,
        on_chunk: Callable[[int], None] = lambda n: None,
        idle_timeout: float = 30.0,
    ) -> tuple[bytes, bytes]:
        """(stated sha256, bytes) of piece `index`, which has `length` bytes. The call's deadline allows for a slow
        link (`piece_deadline`); a stream that goes quiet for `idle_timeout` seconds is given up sooner."""
        call = self.stub(address).FetchPiece(
            pb.PieceRequest(model_id=model_id, piece=index), timeout=piece_deadline(length)
        )
        try:
            digest, data = None, bytearray()
            while True:
                try:
                    message = await asyncio.wait_for(call.read(), idle_timeout)
                except TimeoutError:
                    raise TransportError(
                        Failure(FailureKind.LOST, f"piece {index} stalled for {idle_timeout:g}s", address), "timeout"
                    ) from None
                if message is grpc.aio.EOF:
                    break
                if digest is None:
                    digest = wire_cluster.decode_piece_header(message, length)
                    continue
                if len(data) + len(message.data) > length:
                    raise wire.WireError(f"piece {index} sent more than its {length} bytes")
                data += message.data
                on_chunk(len(message.data))
            if digest is None or len(data) != length:
                raise wire.WireError(f"piece {index} ended after {len(data)} of its {length} bytes")
            return digest, bytes(data)
        finally:
            call.cancel()  # a no-op once the call is over; stops the peer's stream when we give up early

    async def forget(self, address: str) -> None:
        if self.links is not None:
            await self.links.forget(address)
        _, stream = self.streams.pop(address, (None, None))
        if stream is not None:
            await stream.close()
        self._stubs.pop(address, None)
        channel = self.channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for address in {*self.channels, *self.streams}:
            await self.forget(address)
        if self.links is not None:
            await self.links.close()
