"""Per-request records a node keeps, and what the entry node hands to its caller."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from shards.sampling import SampleResult, SamplerState

from .plan import RequestSpec


class GenerationError(RuntimeError):
    """A request failed somewhere in the ring; the message says where and why."""


@dataclass(frozen=True)
class TokenEvent:
    results: tuple[SampleResult, ...]
    finished: bool
    finish_reason: str | None = None


@dataclass
class RequestState:
    """This node's part of one request."""

    spec: RequestSpec
    index: int  # our step in the plan
    sampler: SamplerState | None = None  # last node only
    generated: int = 0  # last node only
    spec_sent: bool = False  # has our successor received the spec?


@dataclass
class Work:
    request_id: str
    data: np.ndarray  # int64 tokens [T] on the first shard, float32 hidden [T, hidden] elsewhere


class Tombstones:
    """Ids of ended requests, so late messages for them are dropped instead of reviving state. Bounded."""

    def __init__(self, size: int = 4096):
        self.ids: OrderedDict[str, None] = OrderedDict()
        self.size = size

    def add(self, request_id: str) -> None:
        self.ids[request_id] = None
        self.ids.move_to_end(request_id)
        while len(self.ids) > self.size:
            self.ids.popitem(last=False)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.ids
