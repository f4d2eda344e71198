"""Whether a node takes part in a request, and the KV cache memory each request it holds reserves.

A request is admitted once, at its first message to this node, and holds its reservation until it ends: a node
never starts what it may not have the memory to finish. Refusals say why: a busy `Failed` (node/core/failures.py)
for a lack of room now (the entry may try again later), a refused one for what this node will never take as asked
(both name the node: the failure carries it), `PlanError` for a request that is not valid anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from node.core.authz import check_plan_members
from node.core.failures import busy, refused
from node.core.plan import PlanError, RequestSpec
from node.core.requests import RequestState
from shards.decoding.sampling import SamplerState
from shards.engines.base import EngineInputError, check_input
from shards.formats.config import ModelConfig
from shards.model.shard import Shard


@dataclass(frozen=True)
class CoreLimits:
    max_requests: int = 256  # concurrent requests this node takes part in
    max_requests_per_entry: int = 192  # of those, at most this many from one entry node (no peer takes them all)
    kv_budget: int | None = None  # bytes of KV cache this node may hold for all its requests (None: no limit)
    kv_value_bytes: int = 4  # bytes of one cached key or value element (float32)
    kv_values_twice: int = 0  # a request's first positions, up to this many, whose values the engine keeps twice
    idle_timeout: float = 60.0  # a request whose next input doesn't come for this long is forgotten
    # of kv_budget, the most the requests of one other entry node may reserve (this node's own are not limited): a
    # key holder can't take all of a peer's memory and leave the other entries' requests a 503
    kv_entry_share: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.kv_entry_share <= 1:
            raise ValueError(f"kv_entry_share must be in (0, 1], got {self.kv_entry_share!r}")


class Admission:
    def __init__(
        self,
        node_id: str,
        model_id: str,
        config: ModelConfig,
        limits: CoreLimits,
        *,
        members: Callable[[], Mapping[str, str]] | None,
        serves: Callable[[Shard], bool],
    ):
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

    @staticmethod
    def check_declared(spec: RequestSpec, arrived: int, more: int) -> None:
        """A request's inputs may bring at most the positions its spec declared (prompt + max_tokens), which is
        what its KV cache reservation was made for: a sender that declares a short prompt and sends a long one
        would otherwise grow caches past what was reserved (PlanError)."""
        if arrived + more > spec.positions:
            raise PlanError(
                f"request {spec.request_id} sent {arrived + more} positions, more than the "
                f"{spec.positions} it declared ({spec.prompt_tokens} prompt + {spec.max_tokens} new)"
            )

    def admit(self, spec: RequestSpec, held: Mapping[str, RequestState], now: float) -> RequestState:
        """The state of a request this node takes part in from now on, its KV cache reserved; `held`: the requests
        held already. Raises a busy or refused Failed (naming this node) or PlanError, reserving nothing, when it can't
        be taken."""
        index = spec.step_of(self.id)
        shard = spec.plan[index].shard
        if (shard.model_id, shard.n_layers) != (self.model_id, self.config.n_layers):
            raise refused(
                f"plan asks for {shard}, this node serves {self.model_id} with {self.config.n_layers} layers", self.id
            )
        if self.draining:
            raise refused("shutting down", self.id)
        if not self.serves(shard):  # a plan made from a stale view of this node's fetching: refuse, never guess
            raise refused(f"does not hold the weights of {shard} yet", self.id)
        if self.members is not None:
            check_plan_members(spec, self.members())
        if len(held) >= self.limits.max_requests:
            raise busy(f"at its limit of {self.limits.max_requests} requests", self.id)
        if sum(r.spec.entry_node_id == spec.entry_node_id for r in held.values()) >= self.limits.max_requests_per_entry:
            raise busy(
                f"holds {self.limits.max_requests_per_entry} requests from entry {spec.entry_node_id}, its limit "
                "for one entry",
                self.id,
            )
        if spec.positions > self.config.max_position_embeddings:
            raise PlanError(
                f"{spec.prompt_tokens} prompt + {spec.max_tokens} new tokens exceed the model's context "
                f"of {self.config.max_position_embeddings}"
            )
        kv_bytes = self.kv_bytes(shard, spec.positions)
        budget = self.limits.kv_budget
        if budget is not None and kv_bytes > budget:
            raise refused(
                f"{spec.positions} positions need {kv_bytes / 2**20:.1f} MiB of KV cache, more than its budget of "
                f"{budget / 2**20:.1f} MiB",
                self.id,
            )
        if budget is not None and self.kv_reserved + kv_bytes > budget:
            raise busy(
                f"KV cache memory is full ({self.kv_reserved / 2**20:.1f} of {budget / 2**20:.1f} MiB reserved)",
                self.id,
            )
        if budget is not None and spec.entry_node_id != self.id:
            self._check_entry_share(spec, kv_bytes, held, budget)
        req = RequestState(spec, index, last_active=now, kv_bytes=kv_bytes)
        self.kv_reserved += kv_bytes
        if shard.is_last:
            req.sampler = SamplerState.from_seed(spec.sampling.seed, 0 if spec.sampling.greedy else spec.resumed)
        return req

    def _check_entry_share(
        self, spec: RequestSpec, kv_bytes: int, held: Mapping[str, RequestState], budget: int
    ) -> None:
        """The requests of another entry node may reserve at most `kv_entry_share` of the budget together."""
        share = int(budget * self.limits.kv_entry_share)
        if kv_bytes > share:
            raise PlanError(
                f"{spec.positions} positions need {kv_bytes / 2**20:.1f} MiB of KV cache on node "
                f"{self.id}, more than one entry's share of {share / 2**20:.1f} MiB"
            )
        entry = spec.entry_node_id
        taken = sum(r.kv_bytes for r in held.values() if r.spec.entry_node_id == entry)
        if taken + kv_bytes > share:
            raise busy(
                f"the requests of entry {entry} hold {taken / 2**20:.1f} MiB of KV cache, "
                f"and may hold at most {share / 2**20:.1f} MiB (kv_entry_share {self.limits.kv_entry_share:g})",
                self.id,
            )

    def release(self, req: RequestState) -> None:
        """The request ended: its KV cache reservation is free again."""
        self.kv_reserved -= req.kv_bytes

    def kv_bytes(self, shard: Shard, positions: int) -> int:
        """KV cache memory `positions` positions take on `shard`: a key and a value per layer and kv head, and the
        values again for the first `kv_values_twice` positions."""
        cfg, limits = self.config, self.limits
        elements = 2 * positions + min(positions, limits.kv_values_twice)
        return elements * shard.layer_count * cfg.n_kv_heads * cfg.head_dim * limits.kv_value_bytes
