"""What one forward pass runs: a token budget per step, decode rows first, prompts in chunks.

Every step the scheduler takes, in arrival order, the decode rows of running requests (one position each, up to
`max_batch_rows`), then fills what is left of the step's token budget with prefill: a prompt (or a prompt's hidden
states, further down the ring) is cut into chunks of at most `prefill_chunk` positions, one chunk per request per
step, so a long prompt is prefilled over several steps while the streams already running keep decoding.

Engines whose speed depends on seeing few distinct shapes declare length buckets (e.g. 16/64/256): a chunk is then
cut to a bucket size where it can be, the budget is charged the bucket's ceiling (what the engine pads to, not the
raw length), and chunks of different buckets never share an engine call (the group key is (shard, bucket)).
Nothing is ever truncated: a prompt longer than the largest bucket is simply cut into more chunks.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shards.shard import Shard


@dataclass(frozen=True)
class SchedulerLimits:
    step_tokens: int = 512  # padded positions one forward pass may carry
    max_batch_rows: int = 64  # decode rows (requests past their prompt) per forward pass
    prefill_chunk: int = 256  # longest piece of a prompt one forward pass prefills for a request
    buckets: tuple[int, ...] | None = None  # the engine's length buckets; None: any length is fine

    def __post_init__(self) -> None:
        if min(self.step_tokens, self.max_batch_rows, self.prefill_chunk) < 1:
            raise ValueError("step tokens, batch rows and prefill chunk must all be >= 1")
        if self.buckets is not None:
            if list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
                raise ValueError(f"buckets must be increasing positive lengths, got {self.buckets}")
            if self.prefill_chunk < self.buckets[0]:
                raise ValueError(f"the prefill chunk {self.prefill_chunk} is below the smallest bucket {self.buckets[0]}")
            if self.buckets[-1] > self.step_tokens:
                raise ValueError(f"the largest bucket {self.buckets[-1]} exceeds the step budget {self.step_tokens}")

    def bucket(self, length: int) -> int | None:
        """The length an engine call pads `length` positions to (decode rows are their own bucket of 1)."""
        if self.buckets is None:
            return None
        if length == 1:
            return 1
        return next((b for b in self.buckets if b >= length), self.buckets[-1])

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


@dataclass(frozen=True)
class Queued:
    """An input waiting for a forward pass."""

    request_id: str
    data: np.ndarray  # int64 tokens [T] on the first shard, float32 hidden states [T, hidden] elsewhere
    partial: bool = False  # a prompt chunk with more of the prompt still to come

    @property
    def decode(self) -> bool:
        return len(self.data) == 1 and not self.partial


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

    def push(self, item: Queued) -> None:
        self.queue.append(item)

    def __len__(self) -> int:
        return len(self.queue)

    def take(self, shard_of: Callable[[str], Shard | None]) -> list[Group]:
        """The next forward pass. `shard_of` says which shard a request runs on (None: it ended; its inputs are
        dropped). Always takes something when anything is queued."""
        lim = self.limits
        budget, rows = lim.step_tokens, 0
        chosen: list[Queued] = []
        taken: set[str] = set()  # requests with an input in this step
        waiting: set[str] = set()  # requests with an earlier input still queued: their later inputs wait too
        rest: deque[Queued] = deque()
        for item in self.queue:  # decode rows first
            rid = item.request_id
            if shard_of(rid) is None:
                continue
            if item.decode and rid not in waiting and rid not in taken and rows < lim.max_batch_rows \
                    and lim.cost(1) <= budget:
                chosen.append(item)
                taken.add(rid)
                rows, budget = rows + 1, budget - lim.cost(1)
            else:
                rest.append(item)
                waiting.add(rid)
        self.queue, waiting = deque(), set()
        for item in rest:  # then prompt chunks, oldest first, in what is left of the budget
            rid = item.request_id
            n = 0
            if not (item.decode or rid in taken or rid in waiting):
                n = lim.chunk(len(item.data), budget)
                if not n and not chosen:  # never an empty step while something waits
                    n = lim.chunk(len(item.data), lim.step_tokens) or 1
            if not n:
                self.queue.append(item)
                waiting.add(rid)
                continue
            head, tail = item.data[:n], item.data[n:]
            chosen.append(Queued(rid, head, partial=len(tail) > 0 or item.partial))
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
