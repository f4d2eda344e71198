"""What one forward pass runs: a token budget per step, decode rows first, prompts in chunks.

Every step the scheduler takes, in arrival order, the decode rows of running requests (one position each, up to
`max_batch_rows`), then fills what is left of the step's token budget with prefill: a prompt (or a prompt's hidden
states, further down the ring) is cut into chunks of at most `prefill_chunk` positions, one chunk per request per
step, so a long prompt is prefilled over several steps while the streams already running keep decoding.

Engines whose speed depends on seeing few distinct shapes declare length buckets (e.g. 16/64/256): a chunk is then
cut to a bucket size where it can be, the budget is charged the bucket's ceiling (what the engine pads to, not the
raw length), and chunks of different buckets never share an engine call (the group key is (shard, bucket)).
Nothing is ever truncated: a prompt longer than the largest bucket is simply cut into more chunks.

A step that carries decode rows carries only as much prefill as keeps it within `max_stall` times a step of decode
rows alone, by what this node measured its own steps to cost (`StepCosts`): on a CPU a 256-position chunk takes
tens of decode steps' time (docs/benchmarks.md, prefill), so a fixed budget would still freeze every running stream
for the length of the chunk.
When nothing is decoding, prefill gets the whole budget. At least `MIN_PREFILL` positions (or the smallest bucket)
go in each step, so a prompt always advances.

Micro-batches: on a ring of S > 1 stages, a step takes at most ceil(R / M) decode rows (`micro_batch_rows`), where R
counts the requests this node holds on such rings and M is `micro_batches` (0: S). Why: the rows of one step travel
the ring together, so with one batch only one stage computes at a time and every other waits for it (three nodes
ran at half one node's speed). Split in M, the batches follow each other round the ring and every stage computes;
each node applies the same cap, so batches that queue up behind a slower stage do not merge again. Results do not
change: a row's numbers never depend on the rows beside it (the engines are batch-invariant; tested).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from shards.model.shard import Shard

MIN_PREFILL = 16  # prompt positions a step beside decode rows always carries, however slow prefill is
EWMA = 0.2  # weight of the newest step in the cost estimates: smooths noise, follows a growing context


@dataclass(frozen=True)
class SchedulerLimits:
    step_tokens: int = 512  # padded positions one forward pass may carry
    max_batch_rows: int = 64  # decode rows (requests past their prompt) per forward pass
    prefill_chunk: int = 256  # longest piece of a prompt one forward pass prefills for a request
    buckets: tuple[int, ...] | None = None  # the engine's length buckets; None: any length is fine
    max_stall: float = 2.0  # a step with decode rows and prefill: at most this many decode-only steps' time
    micro_batches: int = 0  # batches in flight round a ring of several stages; 0: one per stage (see the module)

    def __post_init__(self) -> None:
        if min(self.step_tokens, self.max_batch_rows, self.prefill_chunk) < 1:
            raise ValueError("step tokens, batch rows and prefill chunk must all be >= 1")
        if not isinstance(self.micro_batches, int) or self.micro_batches < 0:
            raise ValueError(f"micro_batches must be an integer >= 0 (0: one per stage), got {self.micro_batches!r}")
        if not self.max_stall > 1:
            raise ValueError(f"the stall limit must be above 1 (a decode step's own time), got {self.max_stall}")
        if self.buckets is not None:
            if list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
                raise ValueError(f"buckets must be increasing positive lengths, got {self.buckets}")
            if self.prefill_chunk < self.buckets[0]:
                raise ValueError(
                    f"the prefill chunk {self.prefill_chunk} is below the smallest bucket {self.buckets[0]}"
                )
            if self.buckets[-1] > self.step_tokens:
                raise ValueError(f"the largest bucket {self.buckets[-1]} exceeds the step budget {self.step_tokens}")

    def bucket(self, length: int) -> int | None:
        """The length an engine call pads `length` positions to (decode rows are their own bucket of 1)."""
        if self.buckets is None:
            return None
        if length == 1:
            return 1
        return next((b for b in self.buckets if b >= length), self.buckets[-1])

    def micro_batch_rows(self, requests: int, stages: int) -> int | None:
        """The most decode rows one step takes when this node holds `requests` requests on rings of `stages`
        stages (the longest): ceil(requests / micro-batches), None (no cap) on a one-stage ring or with one batch."""
        batches = self.micro_batches or stages
        if stages <= 1 or batches <= 1 or requests <= 1:
            return None
        return -(-requests // batches)

    def cost(self, length: int) -> int:
        return self.bucket(length) or length

    def chunk(self, length: int, room: int) -> int:
        """How many of `length` queued prompt positions to prefill now with `room` left in the step (0: none)."""
        most = min(length, self.prefill_chunk)
        if self.buckets is None:
            return max(0, min(most, room))
        if most == length and self.cost(length) <= room and length <= self.buckets[-1]:
            return length  # the rest of the prompt, padded up to its bucket
        fitting = [b for b in self.buckets if b <= min(most, room) and b < length]
        return fitting[-1] if fitting else 0  # a bucket-sized piece: no padding wasted


@dataclass
class StepCosts:
    """What this node's engine calls cost, learnt from the ones it ran (moving averages)."""

    decode_s: float | None = None  # an engine call of decode rows alone
    prefill_s: float | None = None  # one more prompt position in an engine call

    def observe(self, decode_rows: int, prefill_positions: int, seconds: float) -> None:
        if not prefill_positions:
            if decode_rows:
                self.decode_s = _average(self.decode_s, seconds)
            return
        # beside decode rows, a position costs what it adds to their step; alone, its share of the whole call
        extra = seconds - (self.decode_s or 0.0) if decode_rows else seconds
        self.prefill_s = _average(self.prefill_s, max(extra, 0.0) / prefill_positions)

    def prefill_room(self, max_stall: float) -> int | None:
        """Prompt positions a step with decode rows may add to stay within `max_stall` decode steps (None: not
        measured yet)."""
        if self.decode_s is None or not self.prefill_s:
            return None
        return int((max_stall - 1) * self.decode_s / self.prefill_s)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new


@dataclass(frozen=True)
class Queued:
    """An input waiting for a forward pass."""

    request_id: str
    data: np.ndarray  # int64 tokens [T] on the first shard, float32 hidden states [T, hidden] elsewhere
    partial: bool = False  # a prompt chunk with more of the prompt still to come
    proposals: tuple[int, ...] = ()  # the last rows are these draft tokens, verified on the last node
    start: int | None = None  # the cache position of the first row (the engine rolls back to it); None: append
    propose: int = 0  # drafts a deferred proposer (a draft model) is asked for just before the step, off the loop

    @property
    def decode(self) -> bool:
        return len(self.data) == 1 and not self.partial

    @property
    def plain(self) -> bool:
        """A decode row appended as it is: no proposals, none to ask for, no explicit cache position."""
        return self.decode and not self.proposals and self.start is None and not self.propose

    @property
    def stepwise(self) -> bool:
        """A running stream's step: a decode row, or a decode row with proposals (taken whole, never cut: the last
        node verifies every proposal at once), scheduled with the decode rows and charged its positions."""
        return self.decode or bool(self.proposals)


@dataclass(frozen=True)
class Group:
    """Inputs that share one engine call."""

    shard: Shard
    bucket: int | None
    items: tuple[Queued, ...]


class StepScheduler:
    def __init__(self, limits: SchedulerLimits = SchedulerLimits()):
        self.limits = limits
        self.queue: deque[Queued] = deque()
        self.costs = StepCosts()
        self.held_back = 0  # decode rows the last pass left for the next because of its row cap (micro-batches)

    def observe(self, items: Iterable[Queued], seconds: float) -> None:
        """An engine call of `items` (a group's, or a plan's rows: anything with `data` and `stepwise`) took
        `seconds`: the costs that size later steps."""
        items = list(items)
        decode = sum(1 for item in items if item.stepwise)
        self.costs.observe(decode, sum(len(item.data) for item in items if not item.stepwise), seconds)

    def push(self, item: Queued) -> None:
        self.queue.append(item)

    def __len__(self) -> int:
        return len(self.queue)

    def take(self, shard_of: Callable[[str], Shard | None], max_rows: int | None = None) -> list[Group]:
        """The next forward pass. `shard_of` says which shard a request runs on (None: it ended; its inputs are
        dropped); `max_rows` caps its decode rows below `max_batch_rows` (a micro-batch: `micro_batch_rows`).
        Always takes something when anything is queued."""
        lim = self.limits
        budget, rows = lim.step_tokens, 0
        row_cap = lim.max_batch_rows if max_rows is None else max(1, min(max_rows, lim.max_batch_rows))
        chosen: list[Queued] = []
        taken: set[str] = set()  # requests with an input in this step
        waiting: set[str] = set()  # requests with an earlier input still queued: their later inputs wait too
        rest: deque[Queued] = deque()
        self.held_back = 0
        for item in self.queue:  # decode rows first
            rid = item.request_id
            if shard_of(rid) is None:
                continue
            if item.stepwise and rows >= row_cap and rid not in waiting and rid not in taken:
                self.held_back += 1
            if (
                item.stepwise
                and rid not in waiting
                and rid not in taken
                and rows < row_cap
                and lim.cost(len(item.data)) <= budget
            ):
                chosen.append(item)
                taken.add(rid)
                rows, budget = rows + 1, budget - lim.cost(len(item.data))
            else:
                rest.append(item)
                waiting.add(rid)
        self.queue, waiting = deque(), set()
        room = self.costs.prefill_room(lim.max_stall) if chosen else None
        if room is not None:  # decode rows are running: only as much prefill as they can bear
            floor = lim.buckets[0] if lim.buckets else MIN_PREFILL
            budget = min(budget, max(room, floor))
        for item in rest:  # then prompt chunks, oldest first, in what is left of the budget
            rid = item.request_id
            n = 0
            if item.proposals and not chosen and rid not in waiting:
                n = len(item.data)  # more than a step's budget here: it runs alone, whole
            elif not (item.stepwise or rid in taken or rid in waiting):
                n = lim.chunk(len(item.data), budget)
                if not n and not chosen:  # never an empty step while something waits
                    n = lim.chunk(len(item.data), lim.step_tokens) or 1
            if not n:
                self.queue.append(item)
                waiting.add(rid)
                continue
            head, tail = item.data[:n], item.data[n:]
            chosen.append(
                Queued(rid, head, len(tail) > 0 or item.partial, item.proposals, item.start)
                if item.proposals or item.start is not None
                else Queued(rid, head, partial=len(tail) > 0 or item.partial)
            )
            taken.add(rid)
            budget -= lim.cost(n)
            if len(tail):
                self.queue.append(Queued(rid, tail, item.partial))
        groups: dict[tuple, list[Queued]] = {}
        for item in chosen:
            groups.setdefault((shard_of(item.request_id), lim.bucket(len(item.data))), []).append(item)
        return [Group(shard, bucket, tuple(items)) for (shard, bucket), items in groups.items()]

    def drop(self, request_id: str) -> None:
        self.queue = deque(item for item in self.queue if item.request_id != request_id)
