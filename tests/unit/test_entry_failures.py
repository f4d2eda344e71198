"""What the entry does with each kind of failure (node/runtime/entry.py), on the kind alone: busy, it tries again
until the queue timeout and then gives up still busy; lost, it replays the request on a new plan with what was
generated so far, up to --max-replays; refused or error, it fails the request at once, as reported."""

import asyncio
import dataclasses
import time
from collections import Counter

import pytest

from node.core.failures import Failed, Failure, FailureKind
from node.core.requests import TokenMessage
from node.runtime.entry import Entry
from shards.decoding.sampling import SampleResult
from tests.support.factories import CFG
from tests.unit.test_entry_results import PLAN, Ring, started


def entry_for(ring: Ring, **limits) -> Entry:
    tasks = set()

    def spawn(coro):
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    settings = dict(request_timeout=5.0, max_replays=1, queue_timeout=1.0) | limits
    return Entry(
        "entry",
        "h:9",
        ring,
        plan=lambda excluded: PLAN,
        stop_token_ids=frozenset({509}),
        counters=Counter(),
        spawn=spawn,
        vocab_size=CFG.vocab_size,
        **settings,
    )


def failed(rid, kind, detail="why"):
    return TokenMessage(rid, finished=True, finish_reason="error", failure=Failure(kind, detail, "b"))


async def next_prompt(ring: Ring, seen: int):
    while len(ring.prompts) <= seen:
        await asyncio.sleep(0.01)
    return ring.prompts[-1]


def test_a_busy_ring_is_tried_again_then_given_up_on_still_busy_after_the_queue_timeout():
    async def go():
        ring = Ring()
        entry = entry_for(ring, queue_timeout=0.3)
        stream, first, rid = await started(entry, ring)
        while not first.done():  # every attempt's first node answers busy
            tries = len(ring.prompts)
            entry.accept_tokens(failed(rid, FailureKind.BUSY, "KV cache memory is full"), caller="b")
            while len(ring.prompts) == tries and not first.done():
                await asyncio.sleep(0.01)
            rid = ring.prompts[-1].request_id
        with pytest.raises(Failed) as given_up:
            await first
        return given_up.value, len(ring.prompts), entry.counters

    given_up, tries, counters = asyncio.run(go())
    assert given_up.kind is FailureKind.BUSY and "no room for the request within 0.3s" in str(given_up)
    assert tries > 2 and counters["busy_retries"] == tries - 1 and counters["requests_overloaded"] == 1


def test_a_lost_node_is_replayed_with_the_tokens_so_far_then_given_up_on_after_max_replays():
    async def go():
        ring = Ring()
        entry = entry_for(ring, max_replays=1)
        stream, first, rid = await started(entry, ring)
        entry.accept_tokens(TokenMessage(rid, (SampleResult(7),)), caller="c")
        assert (await first).results == (SampleResult(7),)
        second = asyncio.ensure_future(anext(stream))
        entry.accept_tokens(failed(rid, FailureKind.LOST, "forward failed"), caller="b")
        replay = await asyncio.wait_for(next_prompt(ring, 1), 2)
        entry.accept_tokens(failed(replay.request_id, FailureKind.LOST, "forward failed again"), caller="b")
        with pytest.raises(Failed) as given_up:
            await second
        return replay, given_up.value, entry.counters

    replay, given_up, counters = asyncio.run(go())
    assert (replay.resumed, replay.prompt_tokens) == (1, 4)  # the prompt and the token the client already has
    assert given_up.kind is FailureKind.LOST and "gave up after 1 replays" in str(given_up)
    assert counters["replays"] == 2 and counters["requests_failed"] == 1


@pytest.mark.parametrize("kind", [FailureKind.REFUSED, FailureKind.ERROR])
def test_a_refusal_or_an_error_fails_the_request_at_once_as_reported(kind):
    async def go():
        ring = Ring()
        entry = entry_for(ring)
        stream, first, rid = await started(entry, ring)
        entry.accept_tokens(failed(rid, kind, "exceeds the model's context"), caller="b")
        with pytest.raises(Failed) as e:
            await first
        return e.value, len(ring.prompts)

    error, prompts = asyncio.run(go())
    assert error.failure == Failure(kind, "exceeds the model's context", "b") and prompts == 1  # never tried again


def test_a_long_prompt_that_reports_its_chunks_outlives_the_request_timeout_and_a_silent_one_does_not():
    """`--request-timeout` is how long the entry waits without a token. A prompt that takes longer than that to
    prefill (minutes for a 7B on small machines) was failed as a lost node while every node was computing it; each
    chunk through the last node now tells the entry (a message without tokens) that it is alive. The clients see
    tokens only, and a request that stays silent still fails at the timeout."""

    async def go():
        ring = Ring()
        entry = entry_for(ring, request_timeout=0.8)
        entry.stalls = dataclasses.replace(entry.stalls, slice_s=0.05)
        stream, first, rid = await started(entry, ring)
        for _ in range(8):  # 2 s of prefill: over twice the timeout
            await asyncio.sleep(0.25)
            entry.accept_tokens(TokenMessage(rid), caller="c")
        assert not first.done()
        entry.accept_tokens(TokenMessage(rid, (SampleResult(7),)), caller="c")
        got = await first
        began = time.monotonic()
        with pytest.raises(Failed) as silent:
            await anext(stream)
        return got, silent.value, time.monotonic() - began

    got, silent, waited = asyncio.run(go())
    assert got.results == (SampleResult(7),)  # the first message its client sees is its first token
    assert silent.kind is FailureKind.LOST and "no token within 0.8s" in str(silent) and 0.7 < waited < 3


def test_a_streaming_request_arms_a_timer_a_slice_not_one_a_token():
    """The entry looks at the clock every slice while a request runs (its stalls, its timeout), on one timer the
    request re-arms: a timeout around each wait for a token armed and cancelled a timer on the loop per token, at
    every stream's every token. 300 tokens within one slice arm at most the slice's own timer."""

    async def go():
        ring = Ring()
        entry = entry_for(ring)
        loop = asyncio.get_running_loop()
        armed = []
        call_at = loop.call_at
        loop.call_at = lambda when, callback, *args, **kw: (
            armed.append(callback) or call_at(when, callback, *args, **kw)
        )
        stream, first, rid = await started(entry, ring)
        got = []
        for i in range(300):
            entry.accept_tokens(TokenMessage(rid, (SampleResult(7 + i % 5),), finished=i == 299), caller="c")
            got.append(await first if i == 0 else await anext(stream))
        return got, armed

    got, armed = asyncio.run(go())
    assert len(got) == 300 and got[-1].finished
    assert len(armed) <= 2, f"{len(armed)} timers for 300 tokens"


def test_tokens_that_came_while_the_client_was_written_to_go_out_together_and_a_failure_behind_them_after():
    """What is already in a request's inbox when its stream comes back for more joins the message it takes (one
    write to the client, not one a token), in order; a failure never joins: the tokens before it are delivered,
    then it is raised. Nothing is waited for: a lone token goes out alone."""

    async def go():
        ring = Ring()
        entry = entry_for(ring, max_replays=0)
        stream, first, rid = await started(entry, ring)
        entry.accept_tokens(TokenMessage(rid, (SampleResult(7),)), caller="c")
        alone = await first
        for token in (8, 9, 10):
            entry.accept_tokens(TokenMessage(rid, (SampleResult(token),)), caller="c")
        together = await anext(stream)
        entry.accept_tokens(TokenMessage(rid, (SampleResult(11),)), caller="c")
        entry.accept_tokens(failed(rid, FailureKind.ERROR, "the engine failed"), caller="b")
        before = await anext(stream)
        with pytest.raises(Failed) as after:
            await anext(stream)
        return alone, together, before, after.value

    alone, together, before, after = asyncio.run(go())
    assert [r.token for r in alone.results] == [7]
    assert [r.token for r in together.results] == [8, 9, 10] and not together.finished
    assert [r.token for r in before.results] == [11] and "the engine failed" in str(after)


def test_tokens_joined_up_to_the_one_that_finishes_the_request():
    async def go():
        ring = Ring()
        entry = entry_for(ring)
        stream, first, rid = await started(entry, ring)
        entry.accept_tokens(TokenMessage(rid, (SampleResult(7),)), caller="c")
        entry.accept_tokens(TokenMessage(rid, (SampleResult(8),), finished=True, finish_reason="length"), caller="c")
        last = await first
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return last

    last = asyncio.run(go())
    assert [r.token for r in last.results] == [7, 8] and last.finished and last.finish_reason == "length"


def test_a_stream_busy_past_the_request_timeout_still_gets_the_tokens_that_came_meanwhile():
    """The timeout counts silence from the ring, not time the client's stream spent elsewhere: tokens that came
    while the stream was away (a slow client's write) are delivered, even behind a slice that fell due then."""

    async def go():
        ring = Ring()
        entry = entry_for(ring, request_timeout=0.3)
        entry.stalls = dataclasses.replace(entry.stalls, slice_s=0.05)
        stream, first, rid = await started(entry, ring)
        entry.accept_tokens(TokenMessage(rid, (SampleResult(7),)), caller="c")
        await first
        await asyncio.sleep(0.5)  # the stream writes to its client; the ring is silent, then speaks
        entry.accept_tokens(TokenMessage(rid, (SampleResult(8),), finished=True, finish_reason="length"), caller="c")
        await asyncio.sleep(0.1)
        return await anext(stream)

    late = asyncio.run(go())
    assert [r.token for r in late.results] == [8] and late.finished
