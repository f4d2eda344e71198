"""Speculative decoding as the core sees it: which rows a request's next step carries, and what a `start` may undo.

The first node of a request's plan holds its prompt and every token fed since, so it is where proposals are made
(shards/decoding/speculation.py: prompt lookup or a draft model, `Proposer`): when a request's next token t comes back from
the last node, the first node asks for up to k drafts and queues [t, d1..dk] as one input, the drafts named in it
(`Queued.proposals`) and its first row's cache position explicit (`Queued.start`). The chunk travels the ring like
any activation; the last node computes logits for all k+1 rows, verifies them (`shards.decoding.speculation.verify`, through
the sampling batcher) and answers the entry with every accepted token and the first node with the next token,
whose `start` is where that token goes: just past the accepted drafts. Every node rolls the request's cache back
to `start` before computing, which drops the rejected drafts' positions everywhere a trip later (the engines check
it again: shards/engines/base.py `rollback`).

A `start` may only drop the proposals of the input taken last (`check_start`): an accepted token's position is
never undone, and a position never skipped, whatever a peer sends.

How many to propose adapts per request (`DraftLength`: more while they are accepted, none for a while after
repeated failures), within what the request has left: its accepted run can never pass `max_tokens`, so the cache
never grows past the positions its reservation holds (`room`), and within a step's budget.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from node.core.plan import PlanError
from node.core.requests import RequestState
from shards.decoding.sampling import SamplingParams
from shards.decoding.speculation import RATE_WEIGHT, DraftLength, Proposer

log = logging.getLogger(__name__)
MAX_DRAFTS = 32  # proposals per trip at most: more is never accepted in practice, and counters stay few
KEPT_TOKENS = 1 << 20  # tokens of finished requests' texts kept for requests that reuse their caches (4 MB)


@dataclass(frozen=True)
class SpeculationLimits:
    max_drafts: int = 4  # the most tokens proposed for one step of one request (--speculate-tokens)
    # Proposals only while the node holds at most this many requests: a step of a few rows costs about what one
    # row does (the weights are read once), so drafts ride free; with many requests decoding, every draft row is
    # compute the batch pays for (docs/benchmarks.md, concurrent streams)
    max_requests: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.max_drafts, int) or not 1 <= self.max_drafts <= MAX_DRAFTS:
            raise ValueError(f"--speculate-tokens must be an integer in [1, {MAX_DRAFTS}], got {self.max_drafts!r}")
        if not isinstance(self.max_requests, int) or self.max_requests < 1:
            raise ValueError(f"--speculate-max-requests must be an integer >= 1, got {self.max_requests!r}")


def speculates(params: SamplingParams) -> bool:
    """Whether a request is given proposals: unless its client opted out, and not under a grammar (the grammar's
    mask would have to be stepped through every draft; those requests decode one token per trip)."""
    return params.speculate and params.constraint is None


def check_start(req: RequestState, start: int) -> None:
    """A `start` for the request's next input may drop the proposals of its last input, nothing else: it lies
    between the end of the positions accepted for sure and the positions sent so far. Raises PlanError otherwise."""
    low, high = req.positions_in - len(req.drafts), req.positions_in
    if not low <= start <= high:
        raise PlanError(
            f"request {req.id}: start {start} is outside [{low}, {high}] (it may only drop the {len(req.drafts)} "
            "proposals of the previous input)"
        )


class Speculation:
    """The first node's proposals for the requests it holds. `proposer` None: no proposals (`--speculate off`)."""

    def __init__(
        self,
        proposer: Proposer | None,
        limits: SpeculationLimits = SpeculationLimits(),
        *,
        vocab: int,
        deferred: bool = False,
    ):
        """`deferred`: the proposer computes (a draft model): it is not called here but by the driver, off the event
        loop, just before the input's step (`draft`, then the core's `proposed`)."""
        self.proposer, self.limits, self.vocab, self.deferred = proposer, limits, vocab, deferred
        self.row_cost = 0.0  # what a draft row costs here, as a share of a step (`priced`): free until measured
        self.rate = 1.0  # the share of drafts accepted over the node's recent trips: where a new request starts
        self.lengths: dict[str, DraftLength] = {}
        # The text of finished requests whose caches the node keeps for prefix reuse: a request reusing one gets
        # only the rest of its prompt, and its proposals are looked up in the whole text. Most recent last, bounded.
        self.kept: OrderedDict[str, np.ndarray] = OrderedDict()
        self.kept_tokens = 0

    def next_input(
        self, req: RequestState, token: int, start: int, step_room: int, held: int = 1
    ) -> tuple[np.ndarray, tuple, int]:
        """The request's next token came back, to go at cache position `start` (checked: `check_start`): record
        the drafts it accepted and the token, tell the request's DraftLength, and return the input to queue,
        [token, d1..dk], its drafts, and how many drafts to ask a deferred proposer for before its step (0 when
        the proposer was asked here). `step_room`: the most positions one step may carry; `held`: the requests
        this node holds now (no proposals beyond `max_requests`)."""
        accepted = len(req.drafts) - (req.positions_in - start)
        if req.history is not None:
            req.history += [*req.drafts[:accepted], token]
        if req.drafts and (length := self.lengths.get(req.id)) is not None:
            length.update(len(req.drafts), accepted)
            self.rate += RATE_WEIGHT * (accepted / len(req.drafts) - self.rate)
        k = 0
        busy = held > self.limits.max_requests
        if self.proposer is not None and req.history is not None and speculates(req.spec.sampling) and not busy:
            length = self.lengths.get(req.id)
            if length is None:
                length = self.lengths[req.id] = self._length()
            k = max(0, min(length.next(), room(req, start), step_room - 1))
        if self.deferred or not k:
            return np.array([token], dtype=np.int64), (), k
        (drafts,) = self.draft([(req.id, req.history, k)])
        return np.array([token, *drafts], dtype=np.int64), drafts, 0

    def _length(self) -> DraftLength:
        return DraftLength(self.limits.max_drafts, row_cost=self.row_cost, rate=self.rate)

    def priced(self, row_cost: float) -> None:
        """What a draft row costs on this node, as a share of a one-row step (node/runtime/calibration.py
        `draft_row_cost`): requests from now on propose only while their drafts pay for it (`DraftLength`). The
        first node prices the rows every node of the plan computes by its own: a ring's nodes are alike enough."""
        if not (isinstance(row_cost, (int, float)) and 0 <= row_cost < float("inf")):
            raise ValueError(f"a draft row's cost is a finite share >= 0, got {row_cost!r}")
        self.row_cost = float(row_cost)

    def quiet(self, req: RequestState, step_room: int) -> Callable[[int, int], bool]:
        """For a one-node ring's row the engine thread may run on (step_plan.Follow): `quiet(token, left)`, whether
        the request's next input after `token` (`left` tokens left before it) carries no proposals, decided as
        `next_input` would decide it: the same draft length (a pause counts down here as there), the proposer asked
        with the text so far and `token`. Asked on the engine thread once per token, in order, while the loop asks
        nothing for the request; after a token answered False the pass comes back through the queue, where
        next_input asks again (the proposer is a function of the text: it proposes the same)."""
        text, rid = list(req.history or ()), req.id
        length = self.lengths.setdefault(rid, self._length())

        def quiet(token: int, left: int) -> bool:
            text.append(token)
            k = max(0, min(length.next(), left - 2, step_room - 1))  # left - 2: room(), counted from the row's end
            return not k or not self.draft([(rid, text, k)])[0]

        return quiet

    def draft(self, asks: list[tuple[str, list[int], int]]) -> list[tuple[int, ...]]:
        """The proposer's drafts for (request, its text, at most k) each, checked: ids in the vocabulary, at most k
        (a proposer gone wrong costs its requests their proposals, never their output). A proposer that drafts
        several requests at once (`propose_batch`: a draft model's one engine step per pass) is asked once."""
        if self.proposer is None or not asks:
            return [() for _ in asks]
        try:
            batch = getattr(self.proposer, "propose_batch", None)
            if batch is not None and len(asks) > 1:
                size = getattr(self.proposer, "max_requests", len(asks))  # a batch it can hold at once
                proposed = [p for i in range(0, len(asks), size) for p in batch(asks[i : i + size])]
            else:
                proposed = [self.proposer.propose(rid, text, k) for rid, text, k in asks]
        except Exception:
            log.exception("proposer failed for requests %s", [rid for rid, _, _ in asks])
            return [() for _ in asks]
        return [self._checked(p, k) for p, (_, _, k) in zip(proposed, asks)]

    def prefill(self, asks: list[tuple[str, list[int]]]) -> None:
        """Feed a deferred proposer that can (a draft model's `prefill`) each (request, its prompt) now, while the
        served model computes the first token, so its first proposal feeds only what follows (off the loop)."""
        feed = getattr(self.proposer, "prefill", None)
        for rid, text in asks if feed is not None else ():
            try:
                feed(rid, text)
            except Exception:  # only the first proposal's cost: it feeds the prompt itself
                log.exception("draft prefill failed for request %s", rid)

    def _checked(self, proposed: object, k: int) -> tuple[int, ...]:
        try:
            drafts = tuple(int(t) for t in proposed)  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            return ()
        if len(drafts) > k or not all(0 <= t < self.vocab for t in drafts):
            return ()  # propose nothing rather than something half-checked
        return drafts

    def release(self, request_id: str, text: list[int] | None = None) -> None:
        """The request ended: forget its draft length and the proposer's state for it; `text`: it finished and its
        caches are kept for prefix reuse, with these tokens (`kept_text`)."""
        self.lengths.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.release(request_id)
        if text is not None and len(text) <= KEPT_TOKENS:
            self.kept[request_id] = np.asarray(text, dtype=np.int32)
            self.kept_tokens += len(text)
            while self.kept_tokens > KEPT_TOKENS:
                self.kept_tokens -= len(self.kept.popitem(last=False)[1])

    def kept_text(self, request_id: str, positions: int) -> list[int]:
        """The first `positions` tokens of a finished request's text ([] when not kept). The first node never
        hears of the drafts a request's last trip accepted, so a text may be a few tokens short: those are missing
        from what proposals are looked up in, never from the output."""
        text = self.kept.get(request_id) if request_id else None
        if text is None:
            return []
        self.kept.move_to_end(request_id)
        return text[:positions].tolist()


def room(req: RequestState, start: int) -> int:
    """The most drafts a request's step starting at `start` may carry: the token at `start` is generated token
    g = start - prompt + 1, and g + k + 1 (the drafts and the token after them) may not pass max_tokens; so the
    step's last position, start + k, stays below the positions the request reserved."""
    return max(0, req.spec.positions - start - 2)
