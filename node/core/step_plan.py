"""One forward pass as a contract between the core and its driver: schedule -> execute -> update.

`NodeCore.take_batch` answers with `StepPlan`s: everything the pass needs, frozen when it was chosen (each row's
input, the most positions its cache reaches, the retained prefix it starts from, the cache position it rolls back
to, whether every row's logits are wanted, and on the last shard the sampling parameters and sampler state to
sample it with). The driver executes a plan without reading the core (node/runtime/shard_manager.py: the engine
thread runs the pass and samples its rows at once) and hands the result back in one `NodeCore.step_done(plan,
StepOutputs)`. A row whose request ended while the pass ran is dropped there (its caches released), never routed.

A plan's rows may go on without the core: a one-node ring's on its own token (`Follow`, `next_pass`), a ring's
decode row on its next input from a peer, which the core took on the loop as it takes any input (`Row.relay`,
`relayed_pass`); either way the core set the row up to, and records what came. A decode row's message may leave
without the core too: the core names where it goes (`Row.to`, only where the message is the one it would send: a
plain activation, no spec, no proposals, no start; on a ring's last shard, the token back to the first node with its
delivery, that node being the entry, while the token does not end the request, nor is among its last two:
`Row.back`, node/runtime/early_send.py), the engine thread writes it to that peer's data link as the pass ends, and
the core routes only the rows it did not (`StepOutputs.sent`).

Why frozen: the core keeps changing while a pass runs (requests end, inputs arrive); a plan that pointed into it
would make the pass depend on when the engine thread read it. The sampler state is the one object a plan shares
with the core: a request's state is made once at admission and only its own rows (one per pass) advance it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from shards.decoding.sampling import SampleResult, SamplerState, SamplingParams
from shards.model.shard import Shard

PREFIX_GONE = "prefix gone"  # how a refusal for an evicted retained prefix starts (the entry then prefills it all)

Sampled = SampleResult | tuple[SampleResult, ...] | list[SampleResult] | BaseException


@dataclass(frozen=True)
class Sampling:
    """How a row's next token is drawn: the request's parameters and its sampler state (its RNG, its grammar)."""

    params: SamplingParams
    state: SamplerState


@dataclass(frozen=True)
class Follow:
    """A one-node ring's row the engine thread may run on by itself (`next_pass`): its sampled token is its next
    input, unless the token is a stop token, the request has no tokens left after it, or (`quiet`) its next input
    would carry proposals.

    `quiet(token, left)`: the core's answer to "does the request's next input, after `token`, carry no proposals?"
    (node/core/speculation.py `Speculation.quiet`), asked on the engine thread once per token in order (it may keep
    state: a draft length's pause counts down); None for a request that never gets proposals."""

    stops: frozenset[int]
    left: int  # tokens the request may still generate, this pass's included
    quiet: Callable[[int, int], bool] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.left < 1:
            raise ValueError(f"a row with no tokens left ({self.left}) has no next pass to follow")

    def ends(self, token: int) -> bool:
        """Whether the request ends with `token` (a stop token, or none left after it)."""
        return token in self.stops or self.left <= 1

    def drafts_after(self, token: int) -> bool:
        """Whether proposals would come after `token` (asked once per token: `quiet` may count)."""
        return self.quiet is not None and not self.quiet(token, self.left)


@dataclass(frozen=True)
class Row:
    """One request's input in a pass."""

    request_id: str
    data: np.ndarray  # int64 tokens [T] on the first shard, float32 hidden states [T, hidden] elsewhere
    max_positions: int | None = None  # the most positions its cache will hold (sizes it once); None: unknown
    start: int | None = None  # roll the cache back to this position first (speculation); None: append
    reuse: tuple[str, int] | None = None  # start from this finished request's first positions (prefix reuse)
    partial: bool = False  # a prompt chunk with more to come: nothing to sample after it
    proposals: tuple[int, ...] = ()  # its last rows are these drafts: every row's logits are wanted
    propose: int = 0  # drafts a deferred proposer is asked for before the pass (`NodeCore.proposed`)
    sample: Sampling | None = None  # on the last shard, a complete input: sample its next token right after
    follow: Follow | None = None  # a one-node ring's row whose token may go straight into the next pass
    prompt_positions: int | None = None  # positions its prompt fills (its cache may take them at its first chunk)
    relay: bool = False  # a ring's decode row whose next input the engine thread may take itself (`relayed_pass`)
    to: str | None = None  # where the engine thread may send its output on itself (`StepOutputs.sent`)
    back: Follow | None = None  # on a ring's last shard: while its token goes on, the engine thread sends it `to`

    def __post_init__(self) -> None:
        if self.sample is not None and self.partial:
            raise ValueError(f"row {self.request_id}: a prompt chunk with more to come has nothing to sample")
        if self.follow is not None and (self.sample is None or self.proposals or self.propose):
            raise ValueError(f"row {self.request_id}: only a sampled row without proposals is followed")
        if self.proposals and len(self.proposals) >= len(self.data):
            raise ValueError(f"row {self.request_id}: {len(self.proposals)} proposals need more rows than that")
        if self.relay and (
            self.follow or not self.stepwise or self.proposals or self.propose or self.start is not None
        ):
            raise ValueError(f"row {self.request_id}: only a ring's one-position step without proposals is relayed")
        if self.to is not None and (not self.stepwise or self.proposals or self.start is not None):
            raise ValueError(f"row {self.request_id}: only a one-position step without proposals is written early")
        if (self.back is not None) != (self.to is not None and self.sample is not None) or (self.back and self.follow):
            raise ValueError(f"row {self.request_id}: a sampled row written early goes back by its rule, and only it")

    @property
    def stepwise(self) -> bool:
        """A running stream's step (see scheduler.Queued.stepwise)."""
        return (len(self.data) == 1 and not self.partial) or bool(self.proposals)

    @property
    def every_row(self) -> bool:
        """Logits for every row, not only the last: its proposals are verified."""
        return bool(self.proposals)


@dataclass(frozen=True)
class StepPlan:
    """A forward pass over one shard: its rows (one per request) and what retained caches may hold meanwhile."""

    shard: Shard
    bucket: int | None
    rows: tuple[Row, ...]
    retain_limit: int = 0  # bytes finished requests' retained caches may hold (what reservations leave free)

    def __post_init__(self) -> None:
        ids = [r.request_id for r in self.rows]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a pass takes one input per request, got {ids}")
        if not self.shard.is_last and any(r.sample is not None for r in self.rows):
            raise ValueError(f"rows are sampled on the last shard only, not on {self.shard}")
        if not self.shard.is_first and any(r.follow is not None for r in self.rows):
            raise ValueError(f"a token is its own next input on a whole model's shard only, not on {self.shard}")
        if (not self.shard.is_last or self.shard.is_first) and any(r.back is not None for r in self.rows):
            raise ValueError(f"a token goes back to the first node from a ring's last shard only, not {self.shard}")

    @property
    def sampled_rows(self) -> tuple[Row, ...]:
        return tuple(r for r in self.rows if r.sample is not None)

    @property
    def positions(self) -> int:
        return sum(len(r.data) for r in self.rows)


@dataclass(frozen=True)
class StepOutputs:
    """What executing a plan gave: outputs per request (hidden rows, or logits on the last shard), the requests
    whose input the engine refused (and why: left out of the pass, not failing it), the rows already sampled (a
    token, or for a row with proposals the accepted drafts and the token after, or the error that request hit),
    and the seconds the engine computed (on its thread: no queueing in it)."""

    outputs: Mapping[str, np.ndarray | None]  # None: the engine picked the row's token (in `samples`) from its logits
    refused: Mapping[str, str] = field(default_factory=dict)
    samples: Mapping[str, Sampled] = field(default_factory=dict)
    computed: float = 0.0
    followed: frozenset[str] = frozenset()  # rows whose next pass, on their token, the engine thread started
    sent: frozenset[str] = frozenset()  # rows whose output the engine thread wrote to their `Row.to` itself

    def __post_init__(self) -> None:
        if not self.sent <= set(self.outputs):
            raise ValueError(f"requests {sorted(self.sent - set(self.outputs))} sent without outputs")
        if not self.followed <= set(self.samples):
            raise ValueError(f"requests {sorted(self.followed - set(self.samples))} followed without a token")
        if both := set(self.outputs) & set(self.refused):
            raise ValueError(f"requests {sorted(both)} both refused and computed")
        if stray := set(self.samples) - set(self.outputs):
            raise ValueError(f"requests {sorted(stray)} sampled without outputs")
        if unpicked := {rid for rid, out in self.outputs.items() if out is None} - set(self.samples):
            raise ValueError(f"requests {sorted(unpicked)} without outputs were not picked")


def next_pass(plan: StepPlan, samples: Mapping[str, Sampled]) -> StepPlan | None:
    """The pass that follows `plan` on the engine thread with no trip through the core: its followed rows
    (`Row.follow`) whose sampled token goes on, each with that token as its one input (None: no such row). What
    the core would have scheduled for them: a token whose next input is itself, appended to the cache. Called once
    per pass (a row's `quiet` may count). None as well when proposals would come for one of them: the pass's rows
    go back to the core together, so the next step carries them all (one sent back alone split the batch in two)."""
    rows = []
    for row in plan.rows:
        got = samples.get(row.request_id)
        if row.follow is None or not isinstance(got, SampleResult) or row.follow.ends(got.token):
            continue
        if row.follow.drafts_after(got.token):
            return None
        follow = Follow(row.follow.stops, row.follow.left - 1, row.follow.quiet)
        data = np.array([got.token], dtype=np.int64)
        rows.append(Row(row.request_id, data, row.max_positions, sample=row.sample, follow=follow))
    if not rows:
        return None
    return StepPlan(plan.shard, 1 if plan.bucket is not None else None, tuple(rows), plan.retain_limit)


def relayed_pass(plan: StepPlan, inputs: Mapping[str, np.ndarray]) -> StepPlan | None:
    """The pass that follows `plan` on the engine thread for its relayed rows (`Row.relay`) whose next input came
    straight from the data link (`inputs`, by request, taken by the core on the loop: `RequestBook.relay_activations`,
    after the checks every input gets): each with that input, appended to its cache, as the core would have
    scheduled it (None: no such row). A relayed row stays relayed: the core alone decides when one stops being."""
    rows = tuple(
        Row(
            r.request_id,
            inputs[r.request_id],
            r.max_positions,
            sample=r.sample,
            prompt_positions=r.prompt_positions,
            relay=True,
            to=r.to if r.back is None or r.back.left > 1 else None,
            back=Follow(r.back.stops, r.back.left - 1) if r.back is not None and r.back.left > 1 else None,
        )
        for r in plan.rows
        if r.relay and r.request_id in inputs
    )
    if not rows:
        return None
    return StepPlan(plan.shard, 1 if plan.bucket is not None else None, rows, plan.retain_limit)


def awaited(plan: StepPlan, outputs: Mapping[str, np.ndarray]) -> tuple[str, ...]:
    """The relayed rows of a pass that ran (`outputs`): those whose next input the engine thread may wait for."""
    return tuple(r.request_id for r in plan.rows if r.relay and r.request_id in outputs)
