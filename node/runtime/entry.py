"""The entry side of a request: fix its plan, send the prompt to the first node, hand the caller the tokens that
come back, and make sure every node of the plan forgets the request when it ends, however it ends.

An attempt ends in a `Failure` (node/core/failures.py) whose kind says what the entry does. Busy: a node with no
room for the request (its KV cache memory is reserved by others); the entry tries again, backing off, for up to the
queue timeout, then gives up, still busy. Prefix gone: a node no longer holds the retained prefix the attempt
started from; the entry prefills the whole prompt at once. Refused or error: the request fails as it is.

Lost, replay: the entry keeps each request's prompt and the tokens generated so far. When a node of its plan dies,
freezes or can't be reached, the entry ends the old attempt everywhere and resubmits prompt + generated tokens, as one
prefill, on a new plan over the nodes still alive; the caller's stream continues where it was. Sampling is exact
across a replay: every request has a seed (the entry picks one when the client doesn't) and the new last node
skips the random draws the earlier attempts consumed, so greedy and seeded requests give the tokens they would have
given without the failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection
from contextvars import ContextVar
from typing import Any

import numpy as np

from node.core.actions import KEPT_AFTER
from node.core.failures import Failed, Failure, FailureKind, lost
from node.core.logs import node_log
from node.core.plan import PlanStep, RequestSpec
from node.core.prefix_cache import PrefixIndex
from node.core.requests import TokenMessage
from node.runtime.loop_stall import LoopStalls
from node.runtime.token_hold import TokenHold
from node.runtime.transport import Transport, TransportError
from shards.decoding.penalties import with_context
from shards.decoding.sampling import SamplingParams


def _resumed(sampling: SamplingParams, history: list[int]) -> SamplingParams:
    """A replay's sampling: a grammar constraint carries the tokens generated so far, which the new sampling
    node's fresh matcher consumes before sampling (shards/decoding/grammar.py), so the grammar continues exactly."""
    if sampling.constraint is None or not history:
        return sampling
    return dataclasses.replace(sampling, constraint=dataclasses.replace(sampling.constraint, prefix=tuple(history)))


# Who is asking, as the HTTP edge knows it (a digest of the client's API key; "" without one): with --prefix-cache
# per-key, a retained prefix serves only requests of the same key. A context variable because it is a property of
# the request's task, set once where the request comes in (node/http/middleware.py), whatever dialect carries it.
CLIENT_KEY: ContextVar[str] = ContextVar("client_key", default="")


def _scope(plan: tuple[PlanStep, ...], client: str | None = None) -> str:
    """A plan as a prefix-index scope: a retained prefix serves only a plan of the same nodes and layers, and, when
    `client` is given (--prefix-cache per-key), only that client: a shared prefix cache answers a request whose
    prefix another client sent faster, which tells it what that client asked."""
    where = ",".join(f"{s.node_id}:{s.shard.start_layer}-{s.shard.end_layer}" for s in plan)
    return where if client is None else f"{where}|key:{client}"


class _Final(Failed):
    """How the request ends: raised to the caller as it is, never acted on (retried, replayed) by the entry."""


@dataclasses.dataclass
class _Attempt:
    spec: RequestSpec
    inbox: asyncio.Queue  # TokenMessage, or a Failed that ends the attempt
    lost: bool = False
    suspects: set[str] = dataclasses.field(default_factory=set)  # nodes to leave out of a replay's plan
    sliced: bool = False  # a _SLICE waits in the inbox


_SLICE = object()  # in an attempt's inbox: a slice went by (Entry._slice)


def _joined(message: TokenMessage, inbox: asyncio.Queue) -> tuple[TokenMessage, Any]:
    """`message` with the tokens already behind it in `inbox` (those that came while its client was written to),
    and the first item that can't join it (a failure, a slice), if one was taken: the client gets them in one
    write, not one a token. Nothing waits for this: only what has come joins."""
    results, last = list(message.results), message
    while not last.finished and not inbox.empty():
        item = inbox.get_nowait()
        if not isinstance(item, TokenMessage) or item.failure is not None:
            return dataclasses.replace(last, results=tuple(results)), item
        results += item.results
        last = item
    return (message if last is message else dataclasses.replace(last, results=tuple(results))), None


class Entry:
    stalls = LoopStalls()  # one per process: its entries share its event loop, and so its stalls

    def __init__(
        self,
        node_id: str,
        address: str,
        transport: Transport,
        *,
        plan: Callable[[Collection[str]], tuple[PlanStep, ...]],
        stop_token_ids: frozenset[int],
        request_timeout: float,
        max_replays: int,
        queue_timeout: float,
        counters: Counter[str],
        spawn: Callable[..., object],
        vocab_size: int,
        prefixes: PrefixIndex | None = None,
        per_key: bool = False,
        hold: TokenHold | None = None,
    ):
        """`plan`: a new plan over the nodes alive, leaving out the ones given; `spawn` runs a coroutine as a task
        its owner cancels on stop (ending a request everywhere outlives the caller's stream); `vocab_size`: token
        ids at or above it are refused (they come from a broken or hostile node, and would crash the decoder);
        `prefixes`: the finished requests whose caches the nodes of their plan retained (None: no prefix reuse);
        `per_key`: each client's prefixes serve only its own requests (CLIENT_KEY); `hold`: where what the plan
        sends an attempt waits while this node's engine computes the next pass (node/runtime/token_hold.py)."""
        self.node_id, self.address, self.transport, self.plan = node_id, address, transport, plan
        self.vocab_size = vocab_size
        self.stop_token_ids, self.request_timeout, self.max_replays = stop_token_ids, request_timeout, max_replays
        self.queue_timeout = queue_timeout
        self.counters, self.spawn = counters, spawn
        self.attempts: dict[str, _Attempt] = {}  # request id -> the attempt we are the entry node of
        self.prefixes, self.per_key = prefixes, per_key
        self.log = node_log(__name__, node_id)
        self.hold = hold

    async def generate(
        self, prompt: list[int], sampling: SamplingParams, max_tokens: int
    ) -> AsyncIterator[TokenMessage]:
        """Run one request through the ring, yielding tokens as the last node samples them, replaying it on a new
        plan (at most `max_replays` times) when a node of its plan is lost."""
        if sampling.seed is None and not sampling.greedy:
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(64))  # so a replay samples the same
        self.counters["requests"] += 1
        history: list[int] = []  # tokens the caller has received
        excluded: set[str] = set()
        replays, busy_since, backoff = 0, None, 0.05
        reuse = self.prefixes is not None
        while True:
            attempt = self._start(
                prompt + history, _resumed(sampling, history), max_tokens - len(history), len(history), excluded, reuse
            )
            reason = "cancelled"
            try:
                async for message in self._run(attempt):
                    history += [r.token for r in message.results]
                    if message.finished:
                        reason = "finished"  # before the yield: the consumer may close us right there
                    yield message
                    if message.finished:
                        return
            except _Final:
                reason = "failed"
                self.counters["requests_failed"] += 1
                raise
            except Failed as e:
                failure = e.failure
                if failure.kind in (FailureKind.BUSY, FailureKind.PREFIX_GONE) and attempt.spec.reuse_from:
                    # the prefix is gone (or a node is busy: prefilling it all may fit where resuming didn't)
                    reason = "busy"
                    if failure.kind is FailureKind.PREFIX_GONE and self.prefixes is not None:
                        self.prefixes.remove(attempt.spec.reuse_from)  # and its branches: no later request tries it
                    self.counters["prefix_fallbacks"] += 1
                    reuse = False
                elif failure.kind in (FailureKind.BUSY, FailureKind.PREFIX_GONE):
                    reason = "busy"
                    now = time.monotonic()
                    busy_since = busy_since or now
                    if now - busy_since > self.queue_timeout:
                        reason = "failed"
                        self.counters["requests_overloaded"] += 1
                        why = f"no room for the request within {self.queue_timeout:g}s: {failure}"
                        raise _Final(Failure(FailureKind.BUSY, why)) from None
                    self.counters["busy_retries"] += 1
                    await asyncio.sleep(backoff)
                    backoff = min(2 * backoff, 1.0)
                elif failure.kind is FailureKind.LOST:
                    reason = "replayed"
                    replays += 1
                    self.counters["replays"] += 1
                    if replays > self.max_replays:
                        reason = "failed"
                        self.counters["requests_failed"] += 1
                        why = f"{failure} (gave up after {self.max_replays} replays)"
                        raise _Final(Failure(FailureKind.LOST, why)) from None
                    excluded |= attempt.suspects | await self._unreachable(attempt.spec)
                    self.log.warning(
                        "%s; replaying %d prompt + %d generated tokens on a new plan",
                        failure,
                        len(prompt),
                        len(history),
                        extra={"request": attempt.spec.request_id},
                    )
                else:  # refused, error: as it is
                    reason = "failed"
                    self.counters["requests_failed"] += 1
                    raise _Final(failure) from None
            finally:
                self.attempts.pop(attempt.spec.request_id, None)
                branch = None
                if reason in KEPT_AFTER and self.prefixes is not None and history:
                    # every node of the plan has computed prompt + history but the last token (sampled, not fed)
                    # and keeps it (node/core/node_core.py end_request), as a branch of the retained request it
                    # shares the most with; a node that can't says so when asked
                    rid = attempt.spec.request_id
                    self.prefixes.add(rid, (prompt + history)[:-1], self._scope(attempt.spec.plan))
                    branch = self.prefixes.branch_of(rid)
                self.spawn(self._end_everywhere(attempt.spec, reason, branch))

    def _scope(self, plan: tuple[PlanStep, ...]) -> str:
        return _scope(plan, CLIENT_KEY.get() if self.per_key else None)

    def _start(
        self,
        tokens: list[int],
        sampling: SamplingParams,
        max_tokens: int,
        resumed: int,
        excluded: Collection[str],
        reuse: bool = False,
    ) -> _Attempt:
        plan = self.plan(excluded)
        hit = self.prefixes.longest(tokens, self._scope(plan)) if reuse and self.prefixes is not None else None
        if hit is not None:
            self.prefixes.take(hit)  # the nodes hand that cache to this request (or say it is gone)
            self.counters["prefix_hits"] += 1
            self.counters["prefix_hit_tokens"] += hit.tokens
        spec = RequestSpec(
            request_id=uuid.uuid4().hex,
            plan=plan,
            sampling=with_context(sampling, tokens),  # penalties count the prompt's tail (and a replay's history)
            max_tokens=max_tokens,
            stop_token_ids=self.stop_token_ids,
            entry_node_id=self.node_id,
            entry_address=self.address,
            resumed=resumed,
            prompt_tokens=len(tokens),
            reuse_from=hit.entry_id if hit else "",
            reuse_positions=hit.tokens if hit else 0,
        )
        tokens = tokens[spec.reuse_positions :]  # the retained prefix is already in every node's cache
        attempt = self.attempts[spec.request_id] = _Attempt(spec, asyncio.Queue())

        async def send_prompt() -> None:
            try:
                await self.transport.send_prompt(spec.first.address, spec, np.asarray(tokens, np.int64))
            except TransportError as e:
                if e.retryable:
                    attempt.suspects.add(spec.first.node_id)
                self._tell(attempt, Failed(Failure(e.kind, f"sending the prompt failed: {e}", spec.first.node_id)))

        self.spawn(send_prompt())
        return attempt

    async def _run(self, attempt: _Attempt) -> AsyncIterator[TokenMessage]:
        started = heard = time.monotonic()
        self._slice(attempt, started + self.stalls.slice_s)
        pending = None  # what was taken from the inbox behind a message and did not join it
        while True:
            message, pending = (pending if pending is not None else await attempt.inbox.get()), None
            if message is _SLICE:
                attempt.sliced = False
                if not attempt.inbox.empty():
                    continue  # messages came behind it (while the stream was written to): the plan is alive
                if self.stalls.lost(started, heard):  # what the plan owed us may be gone with our stall
                    raise lost("the entry's loop stalled, and nothing came after it")
                if time.monotonic() - heard > self.request_timeout:  # a frozen node is membership's to find
                    raise _Final(Failure(FailureKind.LOST, f"no token within {self.request_timeout:g}s"))
                continue
            heard = time.monotonic()
            if isinstance(message, TokenMessage) and not (message.results or message.finished):
                continue  # a prompt chunk went through the last node: a long prefill is alive, not lost
            if isinstance(message, Failed):
                raise message
            if message.failure is not None:
                raise Failed(message.failure)
            message, pending = _joined(message, attempt.inbox)
            yield message
            if message.finished:
                return

    def _slice(self, attempt: _Attempt, due: float) -> None:
        """Every `slice_s` while the attempt runs: a late call is the loop's stall; an attempt with nothing to read
        is handed a `_SLICE`, so it looks at the clock (silent through a stall, or past the request timeout).
        One timer an attempt, not one a token: a timeout around each wait cost the loop a timer's arming and
        cancelling per token."""
        if self.attempts.get(attempt.spec.request_id) is not attempt:
            return  # ended: no more slices
        loop = asyncio.get_running_loop()
        if loop.time() >= due:
            self.stalls.woke(due - self.stalls.slice_s)
            if attempt.inbox.empty() and not attempt.sliced:
                attempt.sliced = True
                attempt.inbox.put_nowait(_SLICE)
            due = loop.time() + self.stalls.slice_s
        loop.call_at(due, self._slice, attempt, due)

    def accept_tokens(self, message: TokenMessage, caller: str | None = None) -> None:
        """Tokens (or an error) for one of our requests, from a node of its plan (`caller`, when authenticated).

        Only the plan's last node samples, so only it may send tokens or end the request other than with an error
        (any node of the plan may report a failure): a key holder elsewhere in the plan can't put words in the
        answer. Every token id must be in the vocabulary, whoever sends it: an id outside fails the request (it
        would otherwise reach the tokenizer's decoder, which can't take it)."""
        attempt = self.attempts.get(message.request_id)
        if attempt is None or attempt.lost:
            return
        plan = attempt.spec.plan
        if caller is not None and caller not in {step.node_id for step in plan}:
            self.log.request(message.request_id).warning("tokens from %s, which is not in its plan: dropped", caller)
            return
        if caller is not None and caller != plan[-1].node_id and message.finish_reason != "error":
            self.counters["results_refused"] += 1
            self.log.request(message.request_id).warning(
                "tokens from %s, which is not the last node of its plan (%s): dropped",
                caller,
                plan[-1].node_id,
            )
            return
        ids = [t for r in message.results for t in (r.token, *(t for t, _ in r.top_logprobs))]
        if bad := [t for t in ids if not 0 <= t < self.vocab_size]:
            self.counters["results_refused"] += 1
            attempt.lost = True  # nothing more from this attempt is believed
            why = f"sent token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})"
            self._tell(attempt, _Final(Failure(FailureKind.ERROR, why, caller or plan[-1].node_id)))
            return
        self._tell(attempt, message)

    def _tell(self, attempt: _Attempt, item: TokenMessage | Failed) -> None:
        """Put `item` in the attempt's inbox, behind what the hold keeps (so in the order it came)."""
        if self.hold is None:
            attempt.inbox.put_nowait(item)
        else:
            self.hold.put(lambda: attempt.inbox.put_nowait(item))

    def nodes_alive(self, alive: Collection[str]) -> None:
        """Membership's latest view: every attempt whose plan has a node no longer alive is lost."""
        for attempt in self.attempts.values():
            gone = [s.node_id for s in attempt.spec.plan if s.node_id != self.node_id and s.node_id not in alive]
            if gone and not attempt.lost:
                attempt.lost = True
                attempt.suspects.update(gone)
                self._tell(attempt, lost("stopped answering", ", ".join(gone)))

    @property
    def active(self) -> int:
        return len(self.attempts)

    async def _unreachable(self, spec: RequestSpec) -> set[str]:
        """Which of the plan's nodes fail a health check right now (membership may not have noticed yet)."""

        async def down(step: PlanStep) -> bool:
            try:
                await self.transport.health_check(step.address, 1.0)
                return False
            except TransportError:
                return True

        steps = [s for s in spec.plan if s.node_id != self.node_id]
        results = await asyncio.gather(*(down(s) for s in steps))
        return {s.node_id for s, is_down in zip(steps, results) if is_down}

    async def _end_everywhere(self, spec: RequestSpec, reason: str, branch: tuple[str, int] | None = None) -> None:
        async def end(step: PlanStep) -> None:
            try:
                await self.transport.end_request(step.address, spec.request_id, reason, branch)
            except TransportError as e:
                self.log.request(spec.request_id).info("EndRequest to %s failed: %s", step.node_id, e)

        await asyncio.gather(*(end(step) for step in spec.plan))
