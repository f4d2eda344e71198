"""Whether a node takes part in a request, and the KV cache memory each request it holds reserves.

A request is admitted once, at its first message to this node, and holds its reservation until it ends: a node
never starts what it may not have the memory to finish. Refusals say why: `Busy` for a lack of room now (the entry
may try again later), `PlanError` for a request this node will never take as asked.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from shards.engines.base import EngineInputError, check_input
from shards.formats.config import ModelConfig
from shards.sampling import SamplerState
from shards.shard import Shard

from node.core.authz import check_plan_members
from node.core.plan import Busy, PlanError, RequestSpec
from node.core.requests import RequestState


@dataclass(frozen=True)
class CoreLimits:
    max_requests: int = 256  # concurrent requests this node takes part in
    max_requests_per_entry: int = 192  # of those, at most this many from one entry node (no peer takes them all)
    kv_budget: int | None = None  # bytes of KV cache this node may hold for all its requests (None: no limit)
    kv_value_bytes: int = 4  # bytes of one cached key or value element (float32)
    idle_timeout: float = 60.0  # a request whose next input doesn't come for this long is forgotten


class Admission:
    def __init__(self, node_id: str, model_id: str, config: ModelConfig, limits: CoreLimits, *,
                 members: Callable[[], Mapping[str, str]] | None, serves: Callable[[Shard], bool]):
        """`members` and `serves` as NodeCore's (node/core/node_core.py)."""
        self.id, self.model_id, self.config, self.limits = node_id, model_id, config, limits
        self.members, self.serves = members, serves
        self.draining = False  # shutting down: no new requests, the ones held run to their end
        self.kv_reserved = 0  # bytes of KV cache reserved by the requests held

    def check_input(self, first: bool, data: np.ndarray) -> None:
        """Token ids for a first shard, [T, hidden] float32 activations for the others (PlanError otherwise)."""
        try:
            check_input(self.config, first, data, "input")
        except EngineInputError as e:
            raise PlanError(str(e)) from None

    def admit(self, spec: RequestSpec, held: Mapping[str, RequestState], now: float) -> RequestState:
        """The state of a request this node takes part in from now on, its KV cache reserved; `held`: the requests
        held already. Raises Busy or PlanError, reserving nothing, when it can't be taken."""
        index = spec.step_of(self.id)
        shard = spec.plan[index].shard
        if (shard.model_id, shard.n_layers) != (self.model_id, self.config.n_layers):
            raise PlanError(f"plan asks for {shard}, this node serves {self.model_id} "
                            f"with {self.config.n_layers} layers")
        if self.draining:
            raise PlanError(f"node {self.id} is shutting down")
        if not self.serves(shard):  # a plan made from a stale view of this node's fetching: refuse, never guess
            raise PlanError(f"node {self.id} does not hold the weights of {shard} yet")
        if self.members is not None:
            check_plan_members(spec, self.members())
        if len(held) >= self.limits.max_requests:
            raise Busy(f"node {self.id} is at its limit of {self.limits.max_requests} requests")
        if sum(r.spec.entry_node_id == spec.entry_node_id for r in held.values()) \
                >= self.limits.max_requests_per_entry:
            raise Busy(f"node {self.id} holds {self.limits.max_requests_per_entry} requests from entry "
                       f"{spec.entry_node_id}, its limit for one entry")
        if spec.positions > self.config.max_position_embeddings:
            raise PlanError(f"{spec.prompt_tokens} prompt + {spec.max_tokens} new tokens exceed the model's context "
                            f"of {self.config.max_position_embeddings}")
        kv_bytes = self.kv_bytes(shard, spec.positions)
        budget = self.limits.kv_budget
        if budget is not None and kv_bytes > budget:
            raise PlanError(f"{spec.positions} positions need {kv_bytes / 2**20:.1f} MiB of KV cache on node {self.id}, "
                            f"more than its budget of {budget / 2**20:.1f} MiB")
        if budget is not None and self.kv_reserved + kv_bytes > budget:
            raise Busy(f"node {self.id}: KV cache memory is full ({self.kv_reserved / 2**20:.1f} of "
                       f"{budget / 2**20:.1f} MiB reserved)")
        req = RequestState(spec, index, last_active=now, kv_bytes=kv_bytes)
        self.kv_reserved += kv_bytes
        if shard.is_last:
            req.sampler = SamplerState.from_seed(spec.sampling.seed, 0 if spec.sampling.greedy else spec.resumed)
        return req

    def release(self, req: RequestState) -> None:
        """The request ended: its KV cache reservation is free again."""
        self.kv_reserved -= req.kv_bytes

    def kv_bytes(self, shard: Shard, positions: int) -> int:
        """KV cache memory `positions` positions take on `shard`: a key and a value per layer and kv head."""
        cfg = self.config
        return positions * shard.layer_count * 2 * cfg.n_kv_heads * cfg.head_dim * self.limits.kv_value_bytes
