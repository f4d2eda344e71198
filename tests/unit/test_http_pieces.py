"""The text pieces as the API hands them out (node/http/pieces.py): one layer that awaits the first piece before the
response starts, maps the ring's failures to API errors, notes the request's outcome and ends the generation."""

import asyncio

import pytest

from node.core.failures import Failed, Failure, FailureKind
from node.core.plan import PlanError
from node.http.completion import TextDelta
from node.http.pieces import Pieces
from node.http.schema import ApiError
from node.runtime.metrics import RequestObserver


class Observed(RequestObserver):
    def __init__(self):
        self.outcome = None


async def generation(pieces, error=None, closed=None):
    try:
        for piece in pieces:
            yield piece
        if error is not None:
            raise error
    finally:
        if closed is not None:
            closed.append(True)


def run(coro):
    return asyncio.run(coro)


def test_the_first_piece_is_awaited_before_the_response_and_every_piece_comes_once_in_order():
    async def go():
        observed, closed = Observed(), []
        pieces = [TextDelta("a"), TextDelta("b"), TextDelta("", finish_reason="stop")]
        stream = await Pieces(generation(pieces, closed=closed), observed).peek()
        assert stream.head == [pieces[0]]
        got = [p async for p in stream]
        await stream.aclose()
        return got, observed.outcome, closed

    got, outcome, closed = run(go())
    assert [p.text for p in got] == ["a", "b", ""] and outcome == "stop" and closed == [True]


def test_an_empty_generation_hands_out_nothing():
    async def go():
        stream = await Pieces(generation([]), Observed()).peek()
        return [p async for p in stream]

    assert run(go()) == []


@pytest.mark.parametrize(
    "error,status,code",
    [
        (PlanError("no node holds layers 3-5"), 503, "no_plan"),
        (Failed(Failure(FailureKind.BUSY, "no KV room")), 503, None),
        (Failed(Failure(FailureKind.REFUSED, "bad input")), 400, None),
    ],
)
def test_a_ring_failure_before_the_first_piece_is_an_api_error_and_the_outcome_an_error(error, status, code):
    observed = Observed()

    async def go():
        await Pieces(generation([], error), observed).peek()

    with pytest.raises(ApiError) as raised:
        run(go())
    assert raised.value.status == status and (code is None or raised.value.code == code)
    assert observed.outcome == "error"


def test_a_failure_after_pieces_were_handed_out_is_an_api_error_in_the_stream():
    observed = Observed()

    async def go():
        stream = await Pieces(
            generation([TextDelta("a")], Failed(Failure(FailureKind.LOST, "node gone"))), observed
        ).peek()
        got = []
        with pytest.raises(ApiError):
            async for piece in stream:
                got.append(piece.text)
        return got

    assert run(go()) == ["a"] and observed.outcome == "error"
