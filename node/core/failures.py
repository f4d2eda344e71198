"""Why a request (or a call for one) did not go through: one typed value for every layer, free of any transport.

A `Failure` says what whoever receives it may do, not where it came from: try again later (busy), prefill the
whole prompt instead of the retained prefix (prefix_gone), replay the request on another plan (lost), give up
because retrying as sent can't help (refused), or give up on an internal error (error). The core builds them, the
gRPC adapter carries them (node/grpc/wire.py, node/grpc/client.py: status codes <-> kinds), the entry acts on them
(node/runtime/entry.py) and the HTTP edge maps them to statuses once (node/http/failures.py). `Failed` is the one
exception that carries a Failure across a call.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

MAX_DETAIL = 4096  # characters; what a peer may send (node/grpc/wire.py MAX_ERROR)


class FailureKind(StrEnum):
    BUSY = "busy"  # no room right now (KV cache memory, request slots, upload slots): the same call later may work
    PREFIX_GONE = "prefix_gone"  # a node no longer holds the retained prefix the request asked to start from
    LOST = "lost"  # a node or link failed (unreachable, timed out, cut off): the same call elsewhere may work
    REFUSED = "refused"  # invalid or unauthorised as sent: retrying it can't help
    ERROR = "error"  # anything else: a bug or a broken peer


@dataclass(frozen=True)
class Failure:
    """A failure of `kind`, seen at `node` (an id or an address; "" when the detail already says where). A detail
    longer than MAX_DETAIL is cut there, marked: a failure report must never fail itself (an exception's text can
    be any length), and what a peer sends is bounded by the wire codec before it gets here."""

    kind: FailureKind
    detail: str
    node: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FailureKind):
            raise ValueError(f"failure kind must be one of {', '.join(FailureKind)}, got {self.kind!r}")
        if not isinstance(self.detail, str) or not self.detail:
            raise ValueError("a failure needs a detail saying what went wrong")
        if len(self.detail) > MAX_DETAIL:
            object.__setattr__(self, "detail", self.detail[: MAX_DETAIL - 1] + "\u2026")
        if not isinstance(self.node, str):
            raise ValueError(f"a failure's node is an id or an address, got {self.node!r}")

    def __str__(self) -> str:
        return f"node {self.node}: {self.detail}" if self.node else self.detail

    @property
    def later(self) -> bool:
        """The same request may succeed when tried again (as it is, or without its prefix, or elsewhere)."""
        return self.kind in (FailureKind.BUSY, FailureKind.PREFIX_GONE, FailureKind.LOST)


class Failed(Exception):
    """A Failure raised: what crosses a call boundary (the core's admission, a transport call, the entry's
    generation) when one fails. Catch it to act on `failure.kind`; never match on the message."""

    def __init__(self, failure: Failure):
        super().__init__(str(failure))
        self.failure = failure

    @property
    def kind(self) -> FailureKind:
        return self.failure.kind


def busy(detail: str, node: str = "") -> Failed:
    return Failed(Failure(FailureKind.BUSY, detail, node))


def lost(detail: str, node: str = "") -> Failed:
    return Failed(Failure(FailureKind.LOST, detail, node))


def refused(detail: str, node: str = "") -> Failed:
    return Failed(Failure(FailureKind.REFUSED, detail, node))
