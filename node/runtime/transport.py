"""How a node reaches its peers, as the rest of the node sees it: typed messages in, typed errors out.

The gRPC adapter (node/grpc/client.py: client; node/grpc/server.py: service; node/grpc/wire.py: codec) is the only code that knows
about grpc or protobuf; everything else talks to a `Transport`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import numpy as np

from node.core.failures import Failed, Failure, FailureKind
from node.core.plan import PlanError, RequestSpec
from node.core.requests import Activation, Refusal, TokenMessage
from node.core.topology import NodeInfo
from node.fetch.manifest import Manifest


class TransportError(Failed):
    """A call to a peer failed. `failure.kind` says what the caller may do (node/core/failures.py): lost (not
    reachable, or no answer in time: the same call elsewhere may succeed), busy (no room right now: later),
    refused (invalid or unauthorised as sent) or error (anything else, a malformed answer included); `how` says
    what the link saw, for membership: "timeout" (a peer that is only slow), "malformed", or "" otherwise."""

    def __init__(self, failure: Failure, how: str = ""):
        super().__init__(failure)
        self.how = how

    @property
    def retryable(self) -> bool:
        """A node or link failure (as opposed to a refusal): the same call elsewhere may succeed."""
        return self.kind is FailureKind.LOST


class Transport(Protocol):
    max_message_bytes: int  # the largest call a peer takes (node/grpc/client.py's message_bound): sends stay below

    async def send_prompt(self, address: str, spec: RequestSpec, tokens: np.ndarray) -> None: ...

    async def send(
        self,
        address: str,
        activations: tuple[Activation, ...],
        messages: tuple[TokenMessage, ...],
        *,
        on_write: Callable[[], None] | None = None,
    ) -> list[Refusal]:
        """Activations (for requests the peer runs) and token messages (for requests it is the entry node of), in
        one call; returns the activations the peer refused, and why. `on_write` is called as the encoded message is
        handed to the link's write (the hop's counters: node/runtime/overhead.py)."""

    def post(
        self,
        address: str,
        activations: tuple[Activation, ...],
        messages: tuple[TokenMessage, ...],
        *,
        on_write: Callable[[], None] | None = None,
    ) -> Awaitable[list[Refusal]] | None:
        """`send`'s message handed to the link's write now, where that can be done without waiting (a data link
        up: node/grpc/client.py), with its answer (`send`'s) to await; None: `send` it."""

    def write_now(
        self, address: str, activations: tuple[Activation, ...], messages: tuple[TokenMessage, ...] = ()
    ) -> Callable[[], Awaitable[list[Refusal]]] | None:
        """From the engine thread (node/runtime/early_send.py): `activations` and `messages` written to `address` now, where that
        can be done without the loop (a data link up, nothing of the loop's unwritten), and what gives, on the
        loop, `send`'s answer to await; None: nothing was written."""

    async def end_request(
        self, address: str, request_id: str, reason: str, branch: tuple[str, int] | None = None
    ) -> None:
        """The request is over; `branch`: its retained cache shares that many positions with that retained one
        (shards/engines/retained.py `branch`)."""

    async def health_check(self, address: str, timeout: float) -> NodeInfo: ...

    async def leave(self, address: str, node_id: str, timeout: float = 1.0) -> None:
        """Tell a peer we are shutting down."""

    async def manifest(self, address: str, model_id: str, timeout: float = 30.0) -> Manifest:
        """What the peer's copy of the model consists of (node/fetch/)."""

    async def fetch_piece(
        self,
        address: str,
        model_id: str,
        index: int,
        length: int,
        on_chunk: Callable[[int], None] = ...,
        idle_timeout: float = 30.0,
    ) -> tuple[bytes, bytes]:
        """(the sha256 the peer states, the bytes) of one piece of the model; not verified here."""

    async def forget(self, address: str) -> None:
        """Close whatever is kept for `address` (its channel, its data-path stream and that stream's reader task):
        the node no longer reaches it. Membership calls this for every address that stops answering or is no longer
        proposed; a later call to the address connects afresh."""

    async def close(self) -> None: ...


class LocalNode(Protocol):
    """What `Loopback` hands this node's own calls to (node/runtime/node.py's Node)."""

    address: str

    def accept_prompt(self, spec: RequestSpec, tokens: np.ndarray) -> None: ...
    def accept_activations(self, activations: list[Activation], *, local: bool = False) -> list[Refusal]: ...
    def accept_tokens(self, message: TokenMessage) -> None: ...
    def end_request(self, request_id: str, reason: str, branch: tuple[str, int] | None = None) -> None: ...


class Loopback:
    """The transport, except that calls addressed to this very node are handed to it directly: a one-node ring (or
    an entry that is also the last node) needs no network round trip."""

    def __init__(self, node: LocalNode, transport: Transport):
        self.node, self.inner = node, transport

    async def send_prompt(self, address: str, spec: RequestSpec, tokens: np.ndarray) -> None:
        if address != self.node.address:
            return await self.inner.send_prompt(address, spec, tokens)
        try:
            self.node.accept_prompt(spec, tokens)
        except PlanError as e:
            raise TransportError(Failure(FailureKind.REFUSED, str(e))) from None
        except Failed as e:
            raise TransportError(e.failure) from None

    @property
    def address(self) -> str:
        return self.node.address

    async def send(
        self,
        address: str,
        activations: tuple[Activation, ...],
        messages: tuple[TokenMessage, ...],
        *,
        on_write: Callable[[], None] | None = None,
    ) -> list[Refusal]:
        if address != self.node.address:
            return await self.inner.send(address, activations, messages, on_write=on_write)
        return self.accept(activations, messages)

    def post(
        self,
        address: str,
        activations: tuple[Activation, ...],
        messages: tuple[TokenMessage, ...],
        *,
        on_write: Callable[[], None] | None = None,
    ) -> Awaitable[list[Refusal]] | None:
        if address == self.node.address:
            return None  # (what this node sends itself is `accept`ed)
        post = getattr(self.inner, "post", None)  # (a transport without data links has none)
        return None if post is None else post(address, activations, messages, on_write=on_write)

    def accept(self, activations: tuple[Activation, ...], messages: tuple[TokenMessage, ...]) -> list[Refusal]:
        """What this node sends itself, taken at once, in order (the pipeline's `Local`: no task, no call)."""
        for message in messages:
            self.node.accept_tokens(message)
        return self.node.accept_activations(list(activations), local=True) if activations else []

    async def end_request(
        self, address: str, request_id: str, reason: str, branch: tuple[str, int] | None = None
    ) -> None:
        if address != self.node.address:
            return await self.inner.end_request(address, request_id, reason, branch)
        self.node.end_request(request_id, reason, branch=branch)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # health_check, forget, close
