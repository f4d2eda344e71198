"""The requests a node holds and their queued inputs: admitting a request (its prompt, or the first activation
from its predecessor), queueing each input for a forward pass, and forgetting it when it ends. Pure, like the rest
of node/core/: `NodeCore` (node/core/node_core.py) builds on it with what to do with a step's outputs and failures.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Mapping

import numpy as np

from node.core.actions import END_REASONS, KEPT_AFTER, Action, Release
from node.core.admission import Admission, CoreLimits
from node.core.authz import check_caller, predecessor
from node.core.failures import Failed, Failure, FailureKind
from node.core.plan import PlanError, RequestSpec
from node.core.requests import Activation, Refusal, RequestState, Tombstones
from node.core.scheduler import Group, Queued, SchedulerLimits, StepScheduler
from node.core.speculation import Speculation, check_start, speculates
from node.core.step_plan import Follow, Row, Sampling, StepPlan
from shards.formats.config import ModelConfig
from shards.model.shard import Shard

RELAYED, QUEUED = "relayed", "queued"  # what `relay_row` did with an input it took
RETAIN_WITHOUT_BUDGET = 1 << 30  # retained caches' bytes on a node without --kv-memory-gb
KEPT_ENTRIES = 4096  # finished requests whose retained caches their entry may still branch (far more than are kept)


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
        self.kept_by: OrderedDict[str, str] = OrderedDict()  # a retained request -> its entry node (`branch`)
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
        rejected, _ = self.relay_activations(activations, caller)
        return rejected

    def relay_activations(
        self, activations: list[Activation], caller: str | None = None, awaited: Container[str] = ()
    ) -> tuple[list[Refusal], dict[str, np.ndarray]]:
        """`accept_activations`, except that a relayed row's next input (`awaited`: the engine thread waits for it,
        `step_plan.relayed_pass`) that is a plain next position (no proposals, none asked, no explicit start) is
        recorded as taken after the same checks and handed back, by request, for that pass, not queued."""
        rejected, relayed = [], {}
        for a in activations:
            try:
                item = self._taken(a, caller)
            except PlanError as e:
                rejected.append(Refusal(a.request_id, Failure(FailureKind.REFUSED, str(e))))
                continue
            except Failed as e:
                rejected.append(Refusal(a.request_id, e.failure))
                continue
            if isinstance(item, Refusal):
                rejected.append(item)
            elif item is not None and item.request_id in awaited and item.plain:
                self.requests[item.request_id].last_active = self.clock()
                relayed[item.request_id] = item.data
                self.counters["relayed_rows"] += 1
            elif item is not None:
                self._enqueue(item)
        return rejected, relayed

    def relay_row(self, request_id: str, data: np.ndarray, caller: str | None) -> str | None:
        """A relayed row's next input (no start, no proposals: node/runtime/relay.py) taken as `relay_activations`
        takes it where nothing but the checks applies: RELAYED, the engine thread's; QUEUED, with the first node's
        proposals after the token. None, nothing changed, for anything else (unknown or over, the wrong sender, past
        the declared positions, a bad input): the usual way judges it. Why: a ring's every hop, on cold caches."""
        if (req := self._row_request(request_id, data, caller)) is None:
            return None
        item = self._arrived(req, Activation(request_id, data), req.positions_in)
        if not item.plain:
            self._enqueue(item)
            return QUEUED
        req.last_active = self.clock()
        self.counters["relayed_rows"] += 1
        return RELAYED

    def would_relay(self, request_id: str, data: np.ndarray, caller: str | None) -> bool:
        """Whether `relay_row` would take this input, changing nothing (node/grpc/link/server.py `warm`)."""
        return self._row_request(request_id, data, caller) is not None

    def _row_request(self, request_id: str, data: np.ndarray, caller: str | None) -> RequestState | None:
        """The request a decode row's input is for, where `relay_row` may take it (None otherwise)."""
        req = self.requests.get(request_id)
        if req is None or request_id in self.ended or len(data) != 1 or req.positions_in >= req.spec.positions:
            return None
        if caller is not None and caller != predecessor(req.spec, req.step_index):
            return None
        try:
            self.admission.check_input(req.shard.is_first, data)
        except PlanError:
            return None
        return req

    def _taken(self, a: Activation, caller: str | None) -> Queued | Refusal | None:
        """One activation checked and recorded as arrived: the input to queue, a refusal for a request that failed
        here, or None for one that is over (dropped). Raises PlanError or Failed for a bad input."""
        if a.request_id in self.ended:
            if (failure := self.ended.failure(a.request_id)) is not None:  # failed here: the sender must know
                return Refusal(a.request_id, failure)
            return None  # the request is over; a late activation is dropped
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
        return self._arrived(req, a, start)

    def _arrived(self, req: RequestState, a: Activation, start: int) -> Queued:
        """An input checked, recorded as arrived (the first node's proposals made after its token): what to queue."""
        data, proposals, defer = a.data, a.proposals, 0
        if req.shard.is_first and req.history is not None and self.speculation is not None:
            if proposals or len(data) != 1 or a.partial:
                raise PlanError("the first node takes one next token at a time and makes the proposals")
            data, proposals, defer = self.speculation.next_input(
                req, int(data[0]), start, self._step_room(), held=len(self.requests)
            )
        req.drafts, req.chunk_start, req.positions_in = proposals, start, start + len(data)
        explicit = start if a.start is not None or proposals else None
        return Queued(a.request_id, data, a.partial, proposals, explicit, defer)

    def end_request(
        self, request_id: str, reason: str, caller: str | None = None, branch: tuple[str, int] | None = None
    ) -> list[Action]:
        """The request is over (finished, cancelled or failed): forget it and free its caches. From a peer (`caller`
        authenticated), only the request's entry or a node of its plan may end it, and only a member may end a
        request we don't hold (so strangers can't fill the bounded tombstones). `branch`: from the entry, its
        retained cache shares that many positions with another request's (node/core/prefix_cache.py); it may come
        after the request ended here (the last node ends it as it samples the last token)."""
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
            # a counter per reason nodes send (a peer's free text would grow the status map, refused past 256 keys)
            self.counters[f"ended_{reason if reason in END_REASONS else 'unknown'}"] += 1
            self.admission.release(req)
        keep = req is not None and reason in KEPT_AFTER
        if keep:
            self.kept_by[request_id] = req.spec.entry_node_id
            while len(self.kept_by) > KEPT_ENTRIES:
                self.kept_by.popitem(last=False)
        return [Release(request_id, keep=keep, branch=self._branch(request_id, branch, caller))]

    def _branch(self, request_id: str, branch: tuple[str, int] | None, caller: str | None) -> tuple[str, int] | None:
        """A branch is for the entry of both requests to say: no other peer may graft one request's cache onto
        another's (wrong keys and values would answer wrong, silently)."""
        if branch is None:
            return None
        entry = self.kept_by.get(request_id)
        if entry is None or self.kept_by.get(branch[0]) != entry or caller not in (None, entry):
            self.counters["branch_refused"] += 1
            return None
        return branch

    def _admit(self, spec: RequestSpec) -> RequestState:
        req = self.requests[spec.request_id] = self.admission.admit(spec, self.requests, self.clock())
        return req

    def proposal_asks(self, plan: StepPlan) -> list[tuple[str, list[int], int]]:
        """For a deferred proposer (a draft model), before `plan` runs: (request, its text, at most k drafts) for
        each row that asked (`Row.propose`)."""
        return [
            (row.request_id, list(req.history), row.propose)
            for row in plan.rows
            if row.propose and (req := self.requests.get(row.request_id)) is not None and req.history is not None
        ]

    def proposed(self, plan: StepPlan, drafts: Mapping[str, tuple[int, ...]]) -> StepPlan:
        """A deferred proposer's drafts (checked: `Speculation.draft`) by request, for a plan about to run: the plan
        as it runs, each row that got drafts carrying them after its token, from its explicit cache position."""
        rows = []
        for row in plan.rows:
            got, req = drafts.get(row.request_id, ()), self.requests.get(row.request_id)
            if req is None or not got or row.proposals or len(got) > row.propose:
                rows.append(row)
                continue
            start = req.chunk_start
            req.drafts, req.positions_in = got, start + 1 + len(got)
            data = np.concatenate([row.data, np.asarray(got, np.int64)])
            rows.append(dataclasses.replace(row, data=data, proposals=got, start=start, propose=0))
        return dataclasses.replace(plan, rows=tuple(rows))

    def draft_prefills(self, plan: StepPlan) -> list[tuple[str, list[int]]]:
        """After a first-shard step: the requests whose whole prompt it just computed, with their text, for a
        deferred proposer to prefill (`Speculation.prefill`); [] unless this node drafts with a model."""
        spec = self.speculation
        if spec is None or not spec.deferred or not plan.shard.is_first:
            return []
        done = [r.request_id for r in plan.rows if not (r.stepwise or r.partial)]
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

    def take_batch(self) -> list[StepPlan]:
        """The next forward pass, as plans of the inputs that share an engine call (see node/core/scheduler.py and
        node/core/step_plan.py), its decode rows a micro-batch of the requests held here on rings of several
        stages. Each plan carries all the pass needs: the driver reads nothing else of the core to run it."""
        ringed = [len(req.spec.plan) for req in self.requests.values() if len(req.spec.plan) > 1]
        cap = self.queue.limits.micro_batch_rows(len(ringed), max(ringed, default=1))
        groups = self.queue.take(lambda rid: req.shard if (req := self.requests.get(rid)) else None, cap)
        if self.queue.held_back and cap is not None:
            self.counters["micro_batch_passes"] += 1  # a pass that left decode rows to the next micro-batch
        # work left for a later pass (prompts past what the decode rows can bear): no row runs on by itself, or the
        # engine thread would keep the decode rows going to their end while those prompts wait for the next pass
        left = len(self.queue) > 0
        return [self._plan(group, follow=not left) for group in groups]

    def still_held(self, plan: StepPlan) -> StepPlan:
        """`plan` without the rows whose request ended since it was taken (while its engine loaded, say): a pass
        about to start need not compute for them (rows that end while it runs are released by `step_done`)."""
        rows = tuple(r for r in plan.rows if r.request_id in self.requests)
        return plan if len(rows) == len(plan.rows) else dataclasses.replace(plan, rows=rows)

    def _plan(self, group: Group, follow: bool = True) -> StepPlan:
        """The scheduler's group, with what each row's request says about running it, frozen now. `follow`: no
        work is left for a later pass, so rows may run on by themselves: a one-node ring's on its own token
        (`Row.follow`), a ring's decode row on its next input from the data link (`Row.relay`; not under a grammar,
        as `_follow`)."""
        rows = []
        for item in group.items:
            spec = (req := self.requests[item.request_id]).spec  # take() just dropped the ended ones
            sample = None
            if group.shard.is_last and not item.partial and req.sampler is not None:
                sample = Sampling(spec.sampling, req.sampler)
            rows.append(
                Row(
                    item.request_id,
                    item.data,
                    spec.positions if spec.prompt_tokens else None,
                    item.start,
                    (spec.reuse_from, spec.reuse_positions) if spec.reuse_from else None,
                    item.partial,
                    item.proposals,
                    item.propose,
                    sample,
                    self._follow(req)
                    if follow and sample is not None and not (item.proposals or item.propose)
                    else None,
                    spec.prompt_tokens or None,
                    follow and item.plain and len(spec.plan) > 1 and spec.sampling.constraint is None,
                    *(self._route(req, sample is not None) if item.plain else (None, None)),
                )
            )
        return StepPlan(group.shard, group.bucket, tuple(rows), self._retain_limit())

    def _route(self, req: RequestState, sampled: bool) -> tuple[str | None, Follow | None]:
        """Where the engine thread may send a plain decode row's message itself, and on a last shard (`sampled`) the
        rule for its token (`Row.to`, `Row.back`): none here (NodeCore, which routes outputs, knows)."""
        return None, None

    def _follow(self, req: RequestState) -> Follow | None:
        """Whether the engine thread may run the request's row on by itself, its token its next input: on a
        one-node ring, under no grammar, while no proposals would be made for it (`Speculation.next_input`; a draft
        model is asked only here), and with proposals only as the node's one request: beside others, passes that
        come back to the core keep their rows and drafts in one step (measured: docs/benchmarks.md)."""
        spec, speculation = req.spec, self.speculation
        proposes = (
            speculation is not None
            and speculation.proposer is not None
            and req.history is not None
            and speculates(spec.sampling)
            and len(self.requests) <= speculation.limits.max_requests
        )
        if len(spec.plan) > 1 or spec.sampling.constraint is not None or req.generated >= spec.max_tokens:
            return None
        if not proposes:
            return Follow(spec.stop_token_ids, spec.max_tokens - req.generated)
        if speculation.deferred or len(self.requests) > 1:
            return None
        return Follow(spec.stop_token_ids, spec.max_tokens - req.generated, speculation.quiet(req, self._step_room()))

    def followed(self, req: RequestState, token: int) -> None:
        """The engine thread ran the request on with `token` as its next input (`step_plan.next_pass`): what
        `accept_activations` would have recorded had the token come back through the queue."""
        if req.history is not None:
            req.history.append(token)
        req.drafts, req.chunk_start, req.positions_in = (), req.positions_in, req.positions_in + 1
        req.last_active = self.clock()

    def _retain_limit(self) -> int:
        """Bytes finished requests' retained caches may hold: what the requests' reservations leave of the KV
        budget (RETAIN_WITHOUT_BUDGET without one), so retained caches give way before admission refuses anyone."""
        budget = self.limits.kv_budget
        return RETAIN_WITHOUT_BUDGET if budget is None else max(0, budget - self.kv_reserved)

    @property
    def active(self) -> int:
        return len(self.requests)
