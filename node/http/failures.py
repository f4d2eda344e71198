"""The HTTP edge of node/core/failures.py: how a request the ring could not serve leaves the API, in one table.

By the time a failure gets here the entry has done what it could (retried a busy cluster until the queue timeout,
replayed a lost node up to its replay limit), so the status says what the client may do: 503 with Retry-After
when later may work, 400 when the request as sent can't be served, 500 only for an internal error.
"""

from __future__ import annotations

from dataclasses import dataclass

from node.core.failures import Failure, FailureKind
from node.http.schema import ApiError


@dataclass(frozen=True)
class Answer:
    status: int
    code: str
    retry_after: int | None  # seconds, for a Retry-After header
    says: str  # what the message starts with, before the failure's own text


ANSWERS: dict[FailureKind, Answer] = {
    FailureKind.BUSY: Answer(503, "server_overloaded", 2, "the cluster is busy"),
    # only when prefilling it all failed too (the entry retries at once without the prefix)
    FailureKind.PREFIX_GONE: Answer(503, "server_overloaded", 2, "the cluster is busy"),
    FailureKind.LOST: Answer(503, "generation_failed", 1, "generation failed: a node of the cluster was lost"),
    FailureKind.REFUSED: Answer(400, "request_refused", None, "the cluster refused the request"),
    FailureKind.ERROR: Answer(500, "internal_error", None, "generation failed"),
}


def api_error(failure: Failure) -> ApiError:
    """The API error (OpenAI's shape; the other dialects reshape it: node/http/middleware.py) for `failure`."""
    a = ANSWERS[failure.kind]
    return ApiError(a.status, f"{a.says}: {failure}", code=a.code, retry_after=a.retry_after)
