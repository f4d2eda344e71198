"""How a node answers the messages of a data-path stream (node/grpc/server.py's `Answers`): refusals at once, the
rest together within a window, each response saying how many messages it answers."""

import asyncio

from node.core.failures import Failure, FailureKind
from node.core.requests import Refusal
from node.grpc.server import MAX_UNANSWERED, Answers

BUSY = Refusal("r2", Failure(FailureKind.BUSY, "no room"))


def answering(window: float = 0.05):
    sent = []

    async def write(response):
        sent.append((response.answers, [r.request_id for r in response.rejected]))

    return Answers(write, window), sent


def test_the_first_message_of_a_stream_is_answered_at_once_the_next_ones_together_within_the_window():
    async def go():
        answers, sent = answering(window=0.05)
        answers.taken([])
        await asyncio.sleep(0)
        assert sent == [(1, [])]
        answers.taken([])
        answers.taken([])
        await asyncio.sleep(0.01)
        assert sent == [(1, [])]  # within the window: not yet
        await asyncio.sleep(0.1)
        assert sent == [(1, []), (2, [])]
        answers.close()

    asyncio.run(go())


def test_a_message_with_refusals_is_answered_at_once_with_every_message_before_it():
    async def go():
        answers, sent = answering(window=10.0)
        answers.taken([])
        await asyncio.sleep(0)
        answers.taken([])
        answers.taken([BUSY])
        await asyncio.sleep(0)
        assert sent == [(1, []), (2, ["r2"])]
        answers.close()

    asyncio.run(go())


def test_what_is_left_unanswered_when_the_sender_stops_is_answered_by_flush():
    async def go():
        answers, sent = answering(window=10.0)
        for _ in range(4):
            answers.taken([])
            await asyncio.sleep(0)
        await answers.flush()
        assert sent == [(1, []), (3, [])] and sum(n for n, _ in sent) == 4
        answers.close()

    asyncio.run(go())


def test_no_more_than_max_unanswered_messages_wait_for_the_window():
    async def go():
        answers, sent = answering(window=10.0)
        answers.taken([])
        await asyncio.sleep(0)
        for _ in range(MAX_UNANSWERED):
            answers.taken([])
        await asyncio.sleep(0)
        assert sent == [(1, []), (MAX_UNANSWERED, [])]
        answers.close()

    asyncio.run(go())
