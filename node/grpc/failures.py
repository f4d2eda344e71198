"""The gRPC edge of node/core/failures.py: a Failure <-> a call's status code, in one table each way.

A handler aborts with `STATUS[kind]`; the client reads any status back with `failure_of`, which also sorts the
codes gRPC raises by itself (a connection cut, a deadline) into the kinds the callers act on. Every kind survives
the trip: `failure_of(STATUS[k], ...)` has kind k.
"""

from __future__ import annotations

import grpc

from node.core.failures import MAX_DETAIL, Failure, FailureKind

STATUS: dict[FailureKind, grpc.StatusCode] = {
    FailureKind.BUSY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailureKind.PREFIX_GONE: grpc.StatusCode.ABORTED,  # "retry at a higher level": the entry, without the prefix
    FailureKind.LOST: grpc.StatusCode.UNAVAILABLE,
    FailureKind.REFUSED: grpc.StatusCode.INVALID_ARGUMENT,
    FailureKind.ERROR: grpc.StatusCode.UNKNOWN,  # what grpc itself answers for a handler's own exception
}

# status -> (kind, what the link saw: "timeout" is a peer that may only be slow, see node/runtime/membership.py)
_KINDS: dict[grpc.StatusCode, tuple[FailureKind, str]] = {
    grpc.StatusCode.UNAVAILABLE: (FailureKind.LOST, "unavailable"),
    grpc.StatusCode.CANCELLED: (FailureKind.LOST, "unavailable"),  # a call cut off under us: the peer left
    # gRPC's own code for a connection that broke mid-stream ("Internal error from Core", seen when a peer is
    # killed): a link failure, replayable (a handler's own exception is UNKNOWN, which stays an error)
    grpc.StatusCode.INTERNAL: (FailureKind.LOST, "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (FailureKind.LOST, "timeout"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (FailureKind.BUSY, ""),
    grpc.StatusCode.ABORTED: (FailureKind.PREFIX_GONE, ""),
    grpc.StatusCode.INVALID_ARGUMENT: (FailureKind.REFUSED, ""),
    grpc.StatusCode.FAILED_PRECONDITION: (FailureKind.REFUSED, ""),
    grpc.StatusCode.UNAUTHENTICATED: (FailureKind.REFUSED, ""),
    grpc.StatusCode.PERMISSION_DENIED: (FailureKind.REFUSED, ""),
    grpc.StatusCode.NOT_FOUND: (FailureKind.REFUSED, ""),
}


def failure_of(code: grpc.StatusCode, detail: str, address: str) -> tuple[Failure, str]:
    """(the failure, what the link saw) of a call to `address` that ended with `code`."""
    kind, how = _KINDS.get(code, (FailureKind.ERROR, ""))
    return Failure(kind, f"{code.name} {detail}".strip()[:MAX_DETAIL], address), how


async def abort(context: grpc.aio.ServicerContext, failure: Failure) -> None:
    """End the call with `failure` (raises, as context.abort does)."""
    await context.abort(STATUS[failure.kind], str(failure))
