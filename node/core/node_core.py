"""A node's part of every request's ring, as plain Python: no transport, no threads, no event loop.

The core admits requests, queues their inputs, chooses what one forward pass runs, and says what to do with its
outputs. It is driven with typed inputs (a prompt arrived, activations arrived, a step finished, tokens were
sampled, a send failed, a request ended) and answers with typed actions (`Send`, `Deliver`, `Release`, `Sample`)
that the driver (node/runtime/node.py) carries out over the engine thread, the sampling batcher and the transport.
Admitting, queueing and ending requests is `RequestBook`'s (node/core/request_book.py), which `NodeCore` extends
with what to do with a step's outputs and with failures; the actions are node/core/actions.py.

Token ring: the entry node sends the prompt to the first-shard node; each node runs its layers and sends the
activations on; the last node samples, delivers the token to the entry node (for the client) and sends it to the
first node (for the next step).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping

import numpy as np

from node.core.actions import Action, Deliver, Release, Sample, Send
from node.core.failures import Failure, FailureKind
from node.core.logs import node_log
from node.core.plan import RequestSpec
from node.core.request_book import RequestBook
from node.core.requests import Activation, Refusal, RequestState, TokenMessage
from node.core.speculation import MAX_DRAFTS
from node.core.step_plan import PREFIX_GONE, Follow, Sampled, StepOutputs, StepPlan
from shards.decoding.sampling import SampleResult
from shards.formats.config import ModelConfig

log = logging.getLogger(__name__)


def malformed_outputs(config: ModelConfig, plan: StepPlan, outputs: Mapping[str, np.ndarray | None]) -> str | None:
    """What is wrong with a step's outputs, if anything: one float32 array per input, [1, vocab] logits on the
    last shard (a row for each of [t, d1..dk] for an input with proposals), [T, hidden] hidden states elsewhere,
    every value finite; or none for a row whose token the engine picked (StepOutputs holds it: its sampled token is
    validated with the others)."""
    for row in plan.rows:
        out = outputs.get(row.request_id)
        if out is None:
            continue
        rows = len(row.proposals) + 1
        want = (rows, config.vocab_size) if plan.shard.is_last else (len(row.data), config.hidden_size)
        if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != want:
            shape = getattr(out, "shape", type(out).__name__)
            return f"{shape} for request {row.request_id}, expected float32 {list(want)}"
        if not np.isfinite(out).all():
            return f"non-finite values for request {row.request_id}"
    return None


class NodeCore(RequestBook):
    """What to do with a step's outputs and with failures, over the requests held and their queued inputs
    (`RequestBook`, node/core/request_book.py, whose constructor this is)."""

    # -- outputs of a forward pass ----------------------------------------------------------------------------
    def step_done(self, plan: StepPlan, done: StepOutputs) -> list[Action]:
        """The pass `plan` (from `take_batch`) ran: apply what it gave. Refused inputs fail their requests (an
        evicted prefix as PREFIX_GONE: the entry retries without it); hidden rows go on to the next node; on the last
        shard the rows sampled with the pass are delivered and sent back to the first node (`sampled`), and a row
        that was not (the engine thread could not sample it) is asked for with a `Sample` action. Rows whose
        request ended while the pass ran are released, never routed."""
        self.queue.observe(plan.rows, done.computed)
        actions: list[Action] = []
        for rid, why in done.refused.items():
            if why.startswith(PREFIX_GONE):  # the entry prefills the whole prompt instead
                self.counters["prefix_gone"] += 1
                actions += self.failed(rid, Failure(FailureKind.PREFIX_GONE, why, self.id))
            else:
                actions += self.fail(rid, why)
        outputs = done.outputs
        if (problem := malformed_outputs(self.config, plan, outputs)) is not None:
            # Validated as a whole before any row is routed: an engine that got one row wrong can't be trusted
            # with the others of the same call.
            self.counters["malformed_steps"] += 1
            for rid in outputs:
                actions += self.fail(rid, f"the engine returned {problem}")
            return actions
        self.counters["steps"] += 1
        self.counters["step_rows"] += len(outputs)
        self.counters["step_positions"] += sum(len(row.data) for row in plan.rows if row.request_id in outputs)
        self.counters["written_rows"] += len(done.sent)  # rows the engine thread sent on itself (`Row.to`)
        sends: dict[str, list[Activation]] = defaultdict(list)
        results: dict[str, Sampled] = {}
        for row in plan.rows:
            rid = row.request_id
            if rid not in outputs:
                continue
            req = self.requests.get(rid)
            if req is None:
                # Ended during the pass, maybe before its engine existed to queue a release: free what the pass made.
                actions.append(Release(rid))
                continue
            req.last_active = self.clock()
            if plan.shard.is_last:
                if row.sample is None:  # more of the prompt to come: nothing to sample yet
                    if row.partial:  # but the entry hears it is moving (its watchdog waits for a sign of life)
                        actions.append(Deliver(self._entry_address(req.spec), TokenMessage(rid)))
                    continue
                if len(req.spec.plan) == 1 and rid not in done.followed:
                    self.local_inflight.add(rid)  # its token comes back to this node's queue
                if rid in done.samples:
                    results[rid] = done.samples[rid]
                else:
                    logits = outputs[rid] if row.proposals else outputs[rid][-1]
                    actions.append(Sample(rid, logits, row.sample.params, row.sample.state, row.proposals))
            elif rid not in done.sent:  # (a sent row's message is the one `_outgoing` makes: `_route`)
                step = req.next_step
                to = self._address(step.node_id, step.address)
                sends[to].append(self._outgoing(req, outputs[rid], row.partial, row.proposals, row.start))
        actions += [Send(address, tuple(acts)) for address, acts in sends.items()]
        if results:
            self.counters["presampled_rows"] += len(results)
            self.counters["picked_rows"] += sum(1 for rid in results if outputs[rid] is None)
            self.counters["followed_rows"] += len(done.followed)
            actions += self.sampled(results, done.followed, done.sent)
        return actions

    def sampled(
        self, results: Mapping[str, Sampled], followed: frozenset[str] = frozenset(), sent: frozenset[str] = frozenset()
    ) -> list[Action]:
        """Tokens sampled on the last shard (one, or for an input with proposals the accepted drafts and the token
        after them): deliver them to the entry node, cut at a stop token or max_tokens; continue or end the
        request. After proposals the next token goes to the first node with its cache position (`start`), so
        every node drops the rejected drafts' positions before its next step. A `sent` row's token went back with
        its delivery from the engine thread already (`Row.back`), under the rule applied here too."""
        actions: list[Action] = []
        to_first: dict[str, list[Activation]] = defaultdict(list)
        for rid, result in results.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            drafts = req.drafts
            if not isinstance(result, BaseException):
                result = [result] if isinstance(result, SampleResult) else list(result)
                if (
                    not 1 <= len(result) <= len(drafts) + 1
                    or [r.token for r in result[:-1]] != list(drafts)[: len(result) - 1]
                ):
                    result = ValueError(f"{len(result)} results do not verify the {len(drafts)} proposals")
            if isinstance(result, BaseException):
                actions += self.fail(rid, f"sampling failed: {type(result).__name__}: {result}")
                continue
            spec, reason, emitted = req.spec, None, []
            for r in result:
                emitted.append(r)
                req.generated += 1
                reason = (
                    "stop" if r.token in spec.stop_token_ids else "length" if req.generated >= spec.max_tokens else None
                )
                if reason is not None:
                    break
            if drafts:
                self.counters["spec_trips"] += 1
                self.counters["spec_proposed"] += len(drafts)
                self.counters["spec_accepted"] += len(result) - 1
            self.counters[f"tokens_per_trip_{min(len(emitted), MAX_DRAFTS + 1)}"] += 1  # a bounded set of keys
            if rid in sent:  # delivered, and sent back as the next input, from the engine thread (`Row.back`)
                if reason is not None:  # (it leaves a request's last tokens to us: early_send.STALE_PASSES)
                    actions.append(Deliver(self._entry_address(spec), TokenMessage(rid, (), True, reason)))
                    actions += self.end_request(rid, "finished")
                continue
            actions.append(
                Deliver(self._entry_address(spec), TokenMessage(rid, tuple(emitted), reason is not None, reason))
            )
            if reason is None and rid in followed:  # its next pass is running already, on this token
                self.followed(req, result[-1].token)
            elif reason is None:
                first = self._address(spec.first.node_id, spec.first.address)
                start = req.chunk_start + len(result) if drafts else None  # just past the accepted drafts
                token = np.array([result[-1].token], dtype=np.int64)
                to_first[first].append(self._outgoing(req, token, start=start))
            else:
                actions += self.end_request(rid, "finished")
        return actions + [Send(address, tuple(acts)) for address, acts in to_first.items()]

    def _address(self, node_id: str, planned: str) -> str:
        """Where this node sends to `node_id`: where it knows that member itself. The plan carries the entry's view
        of the addresses, and two nodes may know a member by different ones (a hostname and an IP, another
        interface); the plan's own address only where there is no membership to ask."""
        known = self.members().get(node_id) if self.members is not None else None
        return known or planned

    def _route(self, req: RequestState, sampled: bool) -> tuple[str | None, Follow | None]:
        """Where a plain decode row's message goes (no proposals, no start: `_plan` asks for no other row) where it
        is one the engine thread can make itself (`Row.to`): before the last shard, the next node, once the
        request's spec went with an earlier message; on a ring's last shard (`sampled`), the first node where it is
        the entry too (the token and its delivery in one message), under no grammar, with the rule under which the
        token goes on (`Row.back`: not a stop token, tokens left after it)."""
        spec = req.spec
        if not sampled:
            if not req.spec_sent or (step := req.next_step) is None:
                return None, None
            return self._address(step.node_id, step.address), None
        if len(spec.plan) < 2 or spec.sampling.constraint is not None or req.generated >= spec.max_tokens:
            return None, None
        first = self._address(spec.first.node_id, spec.first.address)
        if first != self._entry_address(spec):
            return None, None
        return first, Follow(spec.stop_token_ids, spec.max_tokens - req.generated)

    def _entry_address(self, spec: RequestSpec) -> str:
        return self._address(spec.entry_node_id, spec.entry_address)

    def _outgoing(
        self,
        req: RequestState,
        data: np.ndarray,
        partial: bool = False,
        proposals: tuple[int, ...] = (),
        start: int | None = None,
    ) -> Activation:
        """The spec goes with the first message to our successor (the first node already has it)."""
        spec = None
        if not req.spec_sent and req.next_step is not None:
            spec, req.spec_sent = req.spec, True
        return Activation(req.id, data, spec, partial, proposals, start)

    # -- failures ---------------------------------------------------------------------------------------------
    def fail(
        self, request_id: str, message: str, retryable: bool = False, ended_as: str = "failed", busy: bool = False
    ) -> list[Action]:
        """`failed` with a node or link failure (`retryable`: lost), a lack of room (`busy`) or else an error, seen
        here: the failure names this node, so `message` says only what went wrong."""
        kind = FailureKind.BUSY if busy else FailureKind.LOST if retryable else FailureKind.ERROR
        return self.failed(request_id, Failure(kind, message, self.id), ended_as)

    def failed(self, request_id: str, failure: Failure, ended_as: str = "failed") -> list[Action]:
        """Drop our state for a failed request and tell its entry node why; the failure's kind tells the entry
        what it may do (node/core/failures.py: replay on another plan, try again later, give up)."""
        req = self.requests.get(request_id)
        actions = self.end_request(request_id, ended_as)
        self.ended.add(request_id, failure)
        if req is not None:
            node_log(__name__, self.id).request(request_id).warning("failed: %s", failure)
            actions.append(
                Deliver(
                    self._entry_address(req.spec),
                    TokenMessage(request_id, finished=True, finish_reason="error", failure=failure),
                )
            )
        return actions

    def send_failed(self, address: str, activations: tuple[Activation, ...], why: str, retryable: bool) -> list[Action]:
        """The next node could not be reached (`retryable`), or the call failed otherwise."""
        actions: list[Action] = []
        for a in activations:
            actions += self.fail(a.request_id, f"sending to {address} failed: {why}", retryable)
        return actions

    def refused(self, address: str, refusals: list[Refusal]) -> list[Action]:
        actions: list[Action] = []
        for r in refusals:
            actions += self.failed(r.request_id, Failure(r.failure.kind, f"refused: {r.failure}", address))
        return actions

    def deliver_failed(self, address: str, message: TokenMessage, why: str) -> list[Action]:
        """A message for a request's entry, at `address`, could not be sent (the link broke, or the channel was
        closed under the call). The request ends here, and unless the lost message was itself an error, the entry
        is told at once, in a call of its own, that the request failed and may be replayed: a lost token must not
        leave the entry waiting for one that will never come. Replay resumes from the tokens the entry holds, so
        a token that did arrive after all is neither lost nor repeated. If the entry is really gone, that message
        fails too, and ends nothing more."""
        rid = message.request_id
        node_log(__name__, self.id).request(rid).warning("its result could not reach its entry node: %s", why)
        actions = self.end_request(rid, "failed")
        failure = Failure(FailureKind.LOST, f"a result could not reach the entry ({why}); replay", self.id)
        self.ended.add(rid, failure)
        if message.finish_reason != "error":
            actions.append(Deliver(address, TokenMessage(rid, finished=True, finish_reason="error", failure=failure)))
        return actions

    def expire(self) -> list[Action]:
        """Forget requests idle for longer than the idle timeout: their next input is not coming (an upstream node
        froze or died, or their end was lost). The entry, if it still listens, may replay them."""
        now, actions = self.clock(), []
        queued = {item.request_id for item in self.queue.queue}
        for rid, req in list(self.requests.items()):
            if rid not in queued and now - req.last_active > self.limits.idle_timeout:
                actions += self.fail(
                    rid,
                    f"no input for {self.limits.idle_timeout:g}s",
                    retryable=True,
                    ended_as="expired",
                )
        return actions
