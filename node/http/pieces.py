"""A request's text pieces as the API hands them out: one layer between the generation (node/http/completion.py's
`run_job`) and the response's writes, not one generator each for its jobs.

Its jobs: the ring's failures become API errors (the cluster cannot plan the model: 503 no_plan; a failure: its
status, node/http/failures.py), the request's outcome is noted for the metrics (its finish reason, or "error"), and
the first piece is awaited before the response starts (`peek`), so that a failure before any token is a plain HTTP
error. Every piece passes through one `__anext__`: a stream pays one frame per token here, not three."""

from __future__ import annotations

from collections.abc import AsyncIterator

from node.core.failures import Failed
from node.core.plan import PlanError
from node.http.completion import TextDelta
from node.http.failures import api_error
from node.http.schema import ApiError
from node.runtime.metrics import RequestObserver


class Pieces:
    def __init__(self, pieces: AsyncIterator[TextDelta], observed: RequestObserver):
        self.pieces, self.observed = pieces, observed
        self.head: list[TextDelta] = []  # the piece `peek` awaited, not yet handed out

    def __aiter__(self) -> Pieces:
        return self

    async def __anext__(self) -> TextDelta:
        if self.head:
            return self.head.pop()
        try:
            piece = await anext(self.pieces)
        except StopAsyncIteration:
            raise
        except PlanError as e:
            self.observed.outcome = "error"
            raise ApiError(503, f"the cluster cannot serve this model now: {e}", code="no_plan") from None
        except Failed as e:
            self.observed.outcome = "error"
            raise api_error(e.failure) from None
        except Exception:
            self.observed.outcome = "error"
            raise
        if piece.finish_reason is not None:
            self.observed.outcome = piece.finish_reason
        return piece

    async def peek(self) -> Pieces:
        """The first piece awaited (none: the generation is empty), for the first `__anext__` to hand out."""
        try:
            self.head.append(await self.__anext__())
        except StopAsyncIteration:
            pass
        return self

    async def aclose(self) -> None:
        """Ends the generation under it now (the request on every node of its plan), not when collected."""
        await self.pieces.aclose()
