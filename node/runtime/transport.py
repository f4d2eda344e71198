"""How a node reaches its peers, as the rest of the node sees it: typed messages in, typed errors out.

The gRPC adapter (node/grpc/client.py: client; node/grpc/server.py: service; node/grpc/wire.py: codec) is the only code that knows
about grpc or protobuf; everything else talks to a `Transport`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from node.core.failures import Failed, Failure, FailureKind
from node.core.plan import RequestSpec
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
        self, address: str, activations: tuple[Activation, ...], messages: tuple[TokenMessage, ...]
    ) -> list[Refusal]:
        """Activations (for requests the peer runs) and token messages (for requests it is the entry node of), in
        one call; returns the activations the peer refused, and why."""

    async def end_request(self, address: str, request_id: str, reason: str) -> None: ...

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
