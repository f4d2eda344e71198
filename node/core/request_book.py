"""The requests a node holds and their queued inputs: admitting a request (its prompt, or the first activation
from its predecessor), queueing each input for a forward pass, and forgetting it when it ends. Pure, like the rest
of node/core/: `NodeCore` (node/core/node_core.py) builds on it with what to do with a step's outputs and failures.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping

import numpy as np

from node.core.actions import END_REASONS, KEPT_AFTER, Action, Release
from node.core.admission import Admission, CoreLimits
from node.core.authz import check_caller, predecessor
from node.core.failures import Failed, Failure, FailureKind
from node.core.plan import PlanError, RequestSpec
from node.core.requests import Activation, Refusal, RequestState, Tombstones
from node.core.scheduler import Group, Queued, SchedulerLimits, StepScheduler
from node.core.speculation import Speculation, check_start
from shards.formats.config import ModelConfig
from shards.model.shard import Shard


class RequestBook:
    """Requests held (every request is in `requests` from its admission to its end, then in `ended`) and their
    queued inputs; whether a request is taken, and the memory it reserves, is `admission`'s
    (node/core/admission.py)."""

    def __init__(
        self,
        node_id: str,
        model_id: str,
        config: ModelConfig,
        limits: CoreLimits = CoreLimits(),
        scheduling: SchedulerLimits = SchedulerLimits(),
        clock: Callable[[], float] = time.monotonic,
        members: Callable[[], Mapping[str, str]] | None = None,
        serves: Callable[[Shard], bool] = lambda shard: True,
        speculation: Speculation | None = None,
    ):
        """`members`: the nodes this one knows (id -> address, itself included), which plans must stay within;
        None: plans are not checked against membership. `serves`: whether this node holds a shard's weights now
        (always, unless it fetches them from a peer: node/fetch/follow.py). `speculation`: the proposals this node
        makes as the first node of a plan (node/core/speculation.py); None: none."""
        self.id, self.config, self.limits, self.clock = node_id, config, limits, clock
        self.speculation = speculation
        self.members = members
        self.admission = Admission(node_id, model_id, config, limits, members=members, serves=serves)
        self.requests: dict[str, RequestState] = {}
        self.ended = Tombstones()
        self.queue = StepScheduler(scheduling)
        # Requests of a one-node ring whose next token is being sampled right now: their next step is due within a
        # millisecond or two, so the driver holds the queue back for them (briefly) rather than split the batch.
        self.local_inflight: set[str] = set()
        self.counters: Counter[str] = Counter()

    @property
    def draining(self) -> bool:
        """Shutting down: no new requests, the ones held run to their end."""
        return self.admission.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.admission.draining = value

    @property
    def kv_reserved(self) -> int:
        """Bytes of KV cache reserved by the requests held."""
        return self.admission.kv_reserved

    def kv_bytes(self, shard: Shard, positions: int) -> int:
        return self.admission.kv_bytes(shard, positions)

    # -- inputs from other nodes ------------------------------------------------------------------------------
    def accept_prompt(self, spec: RequestSpec, tokens: np.ndarray, caller: str | None = None) -> None:
        """A new request whose plan makes us the first node, from `caller` (the authenticated member calling, when
        known). Raises PlanError when it can't be taken."""
        check_caller(caller, {spec.entry_node_id}, f"a prompt for request {spec.request_id}")
        if spec.first.node_id != self.id:
            raise PlanError(f"prompt sent to {self.id}, but the plan's first node is {spec.first.node_id}")
        if spec.request_id in self.requests or spec.request_id in self.ended:
            raise PlanError(f"request {spec.request_id} already exists")
        self.admission.check_input(True, tokens)
        # a reused prefix is already in the caches: it counts against what the spec declared
        self.admission.check_declared(spec, spec.reuse_positions, len(tokens))
        req = self._admit(spec)
        req.positions_in = spec.reuse_positions + len(tokens)
        if self.speculation is not None and self.speculation.proposer is not None:
            # what the proposer looks up: the prompt, after the text of the finished request whose cache it reuses
            # (kept for requests without proposals too: a later one may reuse their cache)
            req.history = self.speculation.kept_text(spec.reuse_from, spec.reuse_positions) + [int(t) for t in tokens]
        self._enqueue(Queued(spec.request_id, tokens))

    def accept_activations(self, activations: list[Activation], caller: str | None = None) -> list[Refusal]:
        """Queue each activation (from `caller`, when known); returns the ones refused, and why."""
        rejected = []
        for a in activations:
            if a.request_id in self.ended:
                continue  # the request is over; a late activation is simply dropped
            try:
                req = self.requests.get(a.request_id)
                if req is None:
                    if a.spec is None:
                        raise PlanError(f"unknown request {a.request_id} (this node has no state for it)")
                    if a.spec.step_of(self.id) == 0:
                        raise PlanError("a request starts at its first node with a prompt, not an activation")
                    check_caller(caller, {predecessor(a.spec, a.spec.step_of(self.id))}, f"request {a.request_id}")
                    self.admission.check_declared(a.spec, a.spec.reuse_positions, len(a.data))
                    req = self._admit(a.spec)
                    req.positions_in = a.spec.reuse_positions
                else:
                    check_caller(caller, {predecessor(req.spec, req.step_index)}, f"request {a.request_id}")
                start = req.positions_in if a.start is None else a.start
                check_start(req, start)
                self.admission.check_declared(req.spec, start, len(a.data))
                self.admission.check_input(req.shard.is_first, a.data)
                data, proposals, defer = a.data, a.proposals, 0
                if req.shard.is_first and req.history is not None and self.speculation is not None:
                    if proposals or len(data) != 1 or a.partial:
                        raise PlanError("the first node takes one next token at a time and makes the proposals")
                    data, proposals, defer = self.speculation.next_input(
                        req, int(data[0]), start, self._step_room(), held=len(self.requests)
                    )
                req.drafts, req.chunk_start, req.positions_in = proposals, start, start + len(data)
                explicit = start if a.start is not None or proposals else None
                self._enqueue(Queued(a.request_id, data, a.partial, proposals, explicit, defer))
            except PlanError as e:
                rejected.append(Refusal(a.request_id, Failure(FailureKind.REFUSED, str(e))))
            except Failed as e:
                rejected.append(Refusal(a.request_id, e.failure))
        return rejected

    def end_request(self, request_id: str, reason: str, caller: str | None = None) -> list[Action]:
        """The request is over (finished, cancelled or failed): forget it and free its caches. From a peer (`caller`
        authenticated), only the request's entry or a node of its plan may end it, and only a member may end a
        request we don't hold (so strangers can't fill the bounded tombstones)."""
        if caller is not None:
            req = self.requests.get(request_id)
            allowed = (
                {req.spec.entry_node_id, *(s.node_id for s in req.spec.plan)}
                if req
                else set(self.members() if self.members else ())
            )
            if caller not in allowed:
                self.counters["end_refused"] += 1
                return []
        self.ended.add(request_id)
        self.local_inflight.discard(request_id)
        req = self.requests.get(request_id)
        if self.speculation is not None:
            self.speculation.release(request_id, req.history if req is not None and reason in KEPT_AFTER else None)
        if (req := self.requests.pop(request_id, None)) is not None:
            # a counter per reason: only the reasons nodes send (a peer's free text would grow the status map, which
            # peers refuse past 256 keys)
            self.counters[f"ended_{reason if reason in END_REASONS else 'unknown'}"] += 1
            self.admission.release(req)
        return [Release(request_id, keep=req is not None and reason in KEPT_AFTER)]

    def _admit(self, spec: RequestSpec) -> RequestState:
        req = self.requests[spec.request_id] = self.admission.admit(spec, self.requests, self.clock())
        return req

    def proposed(self, item: Queued, drafts: tuple[int, ...]) -> Queued:
        """A deferred proposer's drafts (checked: `Speculation.draft`) for a queued input about to run (`item`,
        its `propose` asked for): the input as it runs, with them."""
        req = self.requests.get(item.request_id)
        if req is None or not drafts or item.proposals or len(drafts) > item.propose:
            return item
        start = req.chunk_start
        req.drafts, req.positions_in = drafts, start + 1 + len(drafts)
        return Queued(item.request_id, np.concatenate([item.data, np.asarray(drafts, np.int64)]), False, drafts, start)

    def draft_prefills(self, group: Group) -> list[tuple[str, list[int]]]:
        """After a first-shard step: the requests whose whole prompt it just computed, with their text, for a
        deferred proposer to prefill (`Speculation.prefill`); [] unless this node drafts with a model."""
        spec = self.speculation
        if spec is None or not spec.deferred or not group.shard.is_first:
            return []
        done = [i.request_id for i in group.items if not (i.stepwise or i.partial)]
        return [(rid, list(req.history)) for rid in done if (req := self.requests.get(rid)) and req.history]

    def _step_room(self) -> int:
        """The most positions one input may bring to a step here (a step's budget, its largest bucket)."""
        lim = self.queue.limits
        return min(lim.step_tokens, lim.buckets[-1]) if lim.buckets else lim.step_tokens

    def _enqueue(self, item: Queued) -> None:
        self.requests[item.request_id].last_active = self.clock()
        self.queue.push(item)
        self.local_inflight.discard(item.request_id)

    # -- choosing a forward pass ------------------------------------------------------------------------------
    @property
    def should_wait(self) -> bool:
        """Hold queued work back: a one-node ring's tokens are about to join it (see `local_inflight`)."""
        return bool(self.queue) and bool(self.local_inflight)

    def stop_waiting(self) -> None:
        """The wait ran out: a straggler; run without it."""
        self.local_inflight.clear()

    def take_batch(self) -> list[Group]:
        """The next forward pass, as groups of inputs that share an engine call (see node/core/scheduler.py), its
        decode rows a micro-batch of the requests held here on rings of several stages."""
        ringed = [len(req.spec.plan) for req in self.requests.values() if len(req.spec.plan) > 1]
        cap = self.queue.limits.micro_batch_rows(len(ringed), max(ringed, default=1))
        groups = self.queue.take(lambda rid: req.shard if (req := self.requests.get(rid)) else None, cap)
        if self.queue.held_back and cap is not None:
            self.counters["micro_batch_passes"] += 1  # a pass that left decode rows to the next micro-batch
        return groups

    @property
    def active(self) -> int:
        return len(self.requests)
