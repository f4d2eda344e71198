"""What nodes say to each other about requests, and what a node remembers of each, free of any transport."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from node.core.failures import Failure
from node.core.plan import PlanStep, RequestSpec
from shards.decoding.sampling import SampleResult, SamplerState
from shards.model.shard import Shard


@dataclass(frozen=True)
class Activation:
    """One request's input for a node: int64 token ids [T] for the first shard, float32 hidden states [T, hidden]
    for the others."""

    request_id: str
    data: np.ndarray
    spec: RequestSpec | None = None  # travels with a request's first message to each node
    partial: bool = False  # a chunk of the prompt, with more to come: the last node computes it but samples nothing
    # Speculative decoding (node/core/speculation.py): the draft tokens the last rows are (the last node verifies
    # them), and the cache position of the first row: every node first rolls the request's cache back to it, which
    # drops the rejected proposals of the previous trip. None: append at the cache's end.
    proposals: tuple[int, ...] = ()
    start: int | None = None

    def __post_init__(self) -> None:
        if self.start is not None and (not isinstance(self.start, int) or self.start < 0):
            raise ValueError(f"start must be a cache position >= 0, got {self.start!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.proposals):
            raise ValueError("proposals must be token ids >= 0")
        if self.proposals and (len(self.proposals) >= len(self.data) or self.partial or self.start is None):
            raise ValueError(
                f"{len(self.proposals)} proposals need more rows than that ({len(self.data)}), an explicit start "
                "and a complete input (not a prompt chunk)"
            )


@dataclass(frozen=True)
class TokenMessage:
    """From the last node to the entry node: sampled tokens, and whether (and why) the request is over."""

    request_id: str
    results: tuple[SampleResult, ...] = ()
    finished: bool = False
    finish_reason: str | None = None  # stop | length | error
    failure: Failure | None = None  # what went wrong (and what the entry may do), exactly when finish_reason is error

    def __post_init__(self) -> None:
        if (self.failure is not None) != (self.finish_reason == "error") or (self.failure and not self.finished):
            raise ValueError("a token message carries a failure exactly when it finishes with finish_reason error")

    @property
    def error(self) -> str | None:
        return None if self.failure is None else str(self.failure)


@dataclass(frozen=True)
class Refusal:
    """An activation a node would not take, and why (busy: no room right now; refused: a bad input)."""

    request_id: str
    failure: Failure

    @property
    def reason(self) -> str:
        return str(self.failure)


@dataclass
class RequestState:
    """This node's part of one request."""

    spec: RequestSpec
    step_index: int  # our position in the plan
    sampler: SamplerState | None = None  # last node only
    generated: int = 0  # last node only: tokens sampled so far
    spec_sent: bool = False  # has our successor received the spec?
    last_active: float = 0.0  # when its last input arrived or its last step ran (the core's clock)
    kv_bytes: int = 0  # KV cache memory reserved for it on this node
    positions_in: int = 0  # positions its inputs brought so far: never more than the spec declared (`positions`)
    # Speculation (node/core/speculation.py): the proposals of the last input taken and the position of its first
    # row (a later `start` may only drop those proposals); on the first node, the tokens fed so far (the prompt as
    # sent, then every accepted token), which the proposer looks up.
    drafts: tuple[int, ...] = ()
    chunk_start: int = 0
    history: list[int] | None = None

    @property
    def id(self) -> str:
        return self.spec.request_id

    @property
    def step(self) -> PlanStep:
        return self.spec.plan[self.step_index]

    @property
    def shard(self) -> Shard:
        return self.step.shard

    @property
    def next_step(self) -> PlanStep | None:
        return self.spec.plan[self.step_index + 1] if self.step_index + 1 < len(self.spec.plan) else None


class Tombstones:
    """Ids of ended requests, so late messages for them are dropped instead of reviving state, and for those that
    failed here, why: a late activation for one is refused with that failure, so its sender learns the request is
    gone (a node that ended a request because its entry was unreachable may see the entry come back, and the next
    input with it: dropped silently, the entry would wait for its idle timeout). Bounded."""

    def __init__(self, size: int = 4096):
        self.ids: OrderedDict[str, Failure | None] = OrderedDict()
        self.size = size

    def add(self, request_id: str, failure: Failure | None = None) -> None:
        """`failure`: why it failed here (kept over an earlier one's none: a failure ends what it ends at once)."""
        self.ids[request_id] = failure or self.ids.get(request_id)
        self.ids.move_to_end(request_id)
        while len(self.ids) > self.size:
            self.ids.popitem(last=False)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.ids

    def failure(self, request_id: str) -> Failure | None:
        return self.ids.get(request_id)
