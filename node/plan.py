"""A request's plan: which node runs which layers, fixed by the entry node when the request starts.

The plan travels with the request, so every node agrees on the ring even while the topology changes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import discovery.address
from shards.sampling import SamplingParams
from shards.shard import Shard

MAX_REQUEST_ID = 128
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]+$")


class PlanError(ValueError):
    """No valid plan: layers uncovered or doubly covered, malformed steps, or no usable nodes."""


@dataclass(frozen=True)
class PlanStep:
    node_id: str
    address: str  # host:port of the node's gRPC server
    shard: Shard


@dataclass(frozen=True)
class RequestSpec:
    """Everything every node of the plan needs to know about a request."""

    request_id: str
    plan: tuple[PlanStep, ...]
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int]
    entry_node_id: str
    entry_address: str

    def __post_init__(self) -> None:
        if not (0 < len(self.request_id) <= MAX_REQUEST_ID and _REQUEST_ID.match(self.request_id)):
            raise PlanError(f"request id must be 1-{MAX_REQUEST_ID} characters of [A-Za-z0-9._:-]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise PlanError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        check_plan(self.plan)
        parse_address(self.entry_address)

    def step_of(self, node_id: str) -> int:
        for i, step in enumerate(self.plan):
            if step.node_id == node_id:
                return i
        raise PlanError(f"node {node_id!r} is not in the plan of request {self.request_id!r}")

    @property
    def first(self) -> PlanStep:
        return self.plan[0]

    @property
    def last(self) -> PlanStep:
        return self.plan[-1]


def check_plan(plan: tuple[PlanStep, ...]) -> None:
    """The steps must cover [0, n_layers) of one model, in order, without gap or overlap."""
    if not plan:
        raise PlanError("the plan is empty")
    model, n = plan[0].shard.model_id, plan[0].shard.n_layers
    seen: set[str] = set()
    expected = 0
    for step in plan:
        if not step.node_id:
            raise PlanError("plan node ids must be non-empty")
        if step.node_id in seen:
            raise PlanError(f"node {step.node_id!r} appears twice in the plan")
        seen.add(step.node_id)
        parse_address(step.address)
        s = step.shard
        if s.model_id != model or s.n_layers != n:
            raise PlanError(f"plan mixes models: {s} vs {model} with {n} layers")
        if s.start_layer != expected:
            raise PlanError(f"plan step {step.node_id} starts at layer {s.start_layer}, expected {expected}")
        expected = s.end_layer
    if expected != n:
        raise PlanError(f"plan ends at layer {expected}, the model has {n}")


def parse_address(address: str) -> tuple[str, int]:
    try:
        return discovery.address.parse_address(address)
    except ValueError as e:
        raise PlanError(str(e)) from None
