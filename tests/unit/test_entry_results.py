"""Who the entry believes: only the plan's last node samples, so only its tokens reach the client; any member may
report a failure; and no token id outside the vocabulary gets through, whoever sends it."""

import asyncio
from collections import Counter

import pytest

from node.core.failures import Failed, Failure, FailureKind
from node.core.plan import PlanStep
from node.core.requests import TokenMessage
from node.runtime.entry import Entry
from shards.decoding.sampling import SampleResult, SamplingParams
from shards.model.shard import Shard
from tests.support.factories import CFG

PLAN = tuple(PlanStep(n, f"h:{i + 1}", Shard("llama", 2 * i, 2 * i + 2, 6)) for i, n in enumerate("abc"))


class Ring:
    """The transport as the entry sees it, for a ring that takes every prompt and is never reached otherwise:
    what the nodes answer is what each test hands `accept_tokens` itself."""

    def __init__(self):
        self.prompts, self.ended = [], []

    async def send_prompt(self, address, spec, tokens):
        self.prompts.append(spec)

    async def end_request(self, address, request_id, reason, branch=None):
        self.ended.append((address, reason))

    async def health_check(self, address, timeout):
        return None


async def started(entry: Entry, ring: Ring):
    """A request in flight at `entry`: its token stream and its id once the prompt went out."""
    stream = entry.generate([1, 2, 3], SamplingParams(temperature=0), 4)
    first = asyncio.ensure_future(anext(stream))
    while not ring.prompts:
        await asyncio.sleep(0)
    return stream, first, ring.prompts[-1].request_id


def entry_for(ring: Ring) -> Entry:
    tasks = set()

    def spawn(coro):
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return Entry(
        "entry",
        "h:9",
        ring,
        plan=lambda excluded: PLAN,
        stop_token_ids=frozenset({509}),
        request_timeout=5.0,
        max_replays=0,
        queue_timeout=1.0,
        counters=Counter(),
        spawn=spawn,
        vocab_size=CFG.vocab_size,
    )


def tokens(rid, *ids, finished=False):
    return TokenMessage(rid, tuple(SampleResult(t) for t in ids), finished, "length" if finished else None)


def test_tokens_from_a_plan_member_that_is_not_the_last_node_never_reach_the_client():
    async def go():
        ring = Ring()
        entry = entry_for(ring)
        stream, first, rid = await started(entry, ring)
        entry.accept_tokens(tokens(rid, 66, 67, finished=True), caller="b")  # forged by the middle node
        entry.accept_tokens(tokens(rid, 7), caller="c")  # the last node's real token
        assert (await first).results == (SampleResult(7),)
        assert entry.counters["results_refused"] == 1
        await stream.aclose()

    asyncio.run(go())


def test_any_plan_member_may_report_a_failure():
    async def go():
        ring = Ring()
        entry = entry_for(ring)
        stream, first, rid = await started(entry, ring)
        entry.accept_tokens(
            TokenMessage(
                rid, finished=True, finish_reason="error", failure=Failure(FailureKind.ERROR, "b's engine broke")
            ),
            caller="b",
        )
        with pytest.raises(Failed, match="b's engine broke"):
            await first

    asyncio.run(go())


@pytest.mark.parametrize("bad", [CFG.vocab_size, 2**40])
@pytest.mark.parametrize("where", ["token", "top_logprobs"])
def test_a_token_id_outside_the_vocabulary_fails_the_request(bad, where):
    async def go():
        ring = Ring()
        entry = entry_for(ring)
        stream, first, rid = await started(entry, ring)
        result = SampleResult(bad) if where == "token" else SampleResult(5, -0.1, ((bad, -0.2),))
        entry.accept_tokens(TokenMessage(rid, (result,)), caller="c")
        with pytest.raises(Failed, match=f"token id {bad}, outside the vocabulary"):
            await first
        await asyncio.sleep(0.01)
        assert {reason for _, reason in ring.ended} == {"failed"}  # and the ring is told to forget it

    asyncio.run(go())
