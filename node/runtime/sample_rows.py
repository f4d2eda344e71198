"""The rows of one sampling group, sampled on the engine thread: one batched call where the engine has a batched
sampler, each row alone where it hasn't or the batched call fails, and every result validated before anyone gets it.

A group's rows share an engine kind, model, vocab size and dtype (`SampleItem.group_key`). Plain rows go to the
engine's batched sampler stacked, blocks of rows with proposals to `verify_blocks` (shards/decoding/speculation.py)
concatenated; when that raises or returns something malformed, every row's sampler state is rewound and each row
is sampled alone (the fallback, counted with its reason), so a seeded request gets the same token on every path.
A row that fails alone fails only its own request.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from node.core.step_plan import StepPlan
from shards.decoding.sampling import SampleResult, SamplerState, SamplingParams
from shards.decoding.speculation import verify_blocks
from shards.engines.base import Engine
from shards.engines.picks import Draw, Want

log = logging.getLogger(__name__)


class MalformedBatch(ValueError):
    """A batched sampler returned something other than one valid token per row."""


@dataclass(frozen=True)
class SampleItem:
    request_id: str
    logits: np.ndarray  # [vocab]
    params: SamplingParams
    state: SamplerState
    engine: Engine
    model_id: str  # rows of different models never share a call
    drafts: tuple[int, ...] = ()  # proposals to verify: logits then hold len(drafts) + 1 rows

    @property
    def group_key(self) -> tuple:
        return (self.engine.name, self.model_id, self.logits.shape[-1], self.logits.dtype.str)


class Counts(Counter):
    """What sampling one group did (calls, fallbacks, errors), counted on the engine thread and added to the
    batcher's stats on the loop; `fallbacks` keeps one row and the reason per fallback, for the log."""

    def __init__(self):
        super().__init__()
        self.fallbacks: list[tuple[SampleItem, str]] = []

    def fallback(self, items: list[SampleItem], reason: str) -> None:
        self["sample_fallbacks"] += len(items)
        self.fallbacks.append((items[0], reason))


def sample_rows(items: list[SampleItem], batching: bool, counts: Counts) -> list[SampleResult | BaseException]:
    """One token per plain row: stacked through the engine's batched sampler, or each alone."""
    if not items:
        return []
    engine = items[0].engine

    def batched(params: list[SamplingParams], states: list[SamplerState]) -> list[SampleResult]:
        return engine.sample(np.stack([i.logits for i in items]), params, states)  # stacked only when batched

    results = _batched(items, batching, counts, "batched sampler", batched, _validate)
    if results is not None:
        counts["sample_calls"] += 1
        return results
    return [_sample_alone(item, counts) for item in items]


def verify(items: list[SampleItem], batching: bool, counts: Counts) -> list[list[SampleResult] | BaseException]:
    """The tokens each block of rows with proposals emits (its accepted drafts and the token after them): verified
    in one go through the engine's batched sampler, or each alone through `sample_one` row by row."""
    if not items:
        return []
    engine = items[0].engine

    def batched(params: list[SamplingParams], states: list[SamplerState]) -> list[list[SampleResult]]:
        rows = np.concatenate([i.logits for i in items])
        return verify_blocks(rows, [i.drafts for i in items], params, states, sample=engine.sample)

    results = _batched(items, batching, counts, "batched verification", batched, _validate_blocks)
    if results is not None:
        counts["sample_verify_calls"] += 1
        return results
    out: list[list[SampleResult] | BaseException] = []
    for item in items:
        try:
            block = verify_blocks(item.logits, [item.drafts], [item.params], [item.state], sample=_row_by_row(engine))
            _validate_block(block[0], item)
            counts["sample_verify_calls"] += 1
            out.append(block[0])
        except Exception as e:  # only this request fails
            counts["sample_errors"] += 1
            log.warning("verifying proposals failed for request %s: %s", item.request_id, type(e).__name__)
            out.append(e)
    return out


def _batched(
    items: list[SampleItem], batching: bool, counts: Counts, what: str, call: Callable, check: Callable
) -> list | None:
    """`call(params, states)`'s results for every row at once, valid by `check(results, items)`, or None when the
    rows must go alone: batching is off, the engine has no batched sampler, or the call failed (then every sampler
    state is rewound first, so the rows alone draw what they would have)."""
    if len(items) < 2:
        return None
    if not batching or not items[0].engine.batched_sampling:
        counts.fallback(items, "engine has no batched sampler" if batching else "batching disabled")
        return None
    snapshots = [i.state.snapshot() for i in items]
    try:
        results = call([i.params for i in items], [i.state for i in items])
        check(results, items)
        return results
    except Exception as e:
        for item, snap in zip(items, snapshots):
            item.state.restore(snap)
        counts.fallback(items, f"{what} failed: {type(e).__name__}")
        return None


def _row_by_row(engine: Engine) -> Callable[..., list[SampleResult]]:
    """An engine's rows sampled each on its own (`sample_one`), in the shape of its batched sampler."""
    return lambda rows, params, states: [engine.sample_one(r, p, s) for r, p, s in zip(rows, params, states)]


def _sample_alone(item: SampleItem, counts: Counts) -> SampleResult | BaseException:
    try:
        result = item.engine.sample_one(item.logits, item.params, item.state)
        _validate([result], [item])
        counts["sample_calls"] += 1
        return result
    except Exception as e:  # only this request fails
        counts["sample_errors"] += 1
        log.warning("sampling failed for request %s: %s", item.request_id, type(e).__name__)
        return e


def _validate_blocks(blocks: object, items: list[SampleItem]) -> None:
    if not isinstance(blocks, list) or len(blocks) != len(items):
        raise MalformedBatch(f"expected {len(items)} blocks, got {type(blocks).__name__}")
    for block, item in zip(blocks, items):
        _validate_block(block, item)


def _validate_block(block: object, item: SampleItem) -> None:
    """1..k+1 valid results whose all but the last repeat the drafts (the accepted ones)."""
    if not isinstance(block, list) or not 1 <= len(block) <= len(item.drafts) + 1:
        raise MalformedBatch(f"expected 1 to {len(item.drafts) + 1} results, got {type(block).__name__}")
    row = dataclasses.replace(item, logits=item.logits[0], drafts=())
    _validate(block, [row] * len(block))
    if [r.token for r in block[:-1]] != list(item.drafts[: len(block) - 1]):
        raise MalformedBatch("the accepted tokens are not the drafts")


def _validate(results: object, items: list[SampleItem]) -> None:
    if not isinstance(results, list) or len(results) != len(items):
        raise MalformedBatch(f"expected {len(items)} results, got {type(results).__name__}")
    for r, item in zip(results, items):
        vocab = item.logits.shape[-1]
        if not isinstance(r, SampleResult) or not isinstance(r.token, (int, np.integer)) or not 0 <= r.token < vocab:
            raise MalformedBatch(f"result {r!r} is not a token id in [0, {vocab})")
        wanted = item.params.top_logprobs
        if wanted is None:
            continue
        if (
            not (_ok_logprob(r.logprob) and math.isfinite(r.logprob))
            or len(r.top_logprobs) != min(wanted, vocab)
            or not all(_ok_logprob(lp) and 0 <= t < vocab for t, lp in r.top_logprobs)
        ):
            raise MalformedBatch("logprobs missing, out of range or not finite")


def _ok_logprob(x: object) -> bool:
    return isinstance(x, float) and not math.isnan(x) and x <= 1e-6  # -inf is fine for an impossible alternative


def picked_results(plan: StepPlan, picked: Mapping[str, tuple[int, ...]]) -> dict[str, SampleResult | list]:
    """What the rows whose greedy tokens the engine picked emit (shards/engines/picks.py): a row's token, or for a
    block with proposals what `verify_blocks` gives greedy rows: the drafts equal to their row's token, then the
    token after them (row i's token follows draft i)."""
    out: dict[str, SampleResult | list] = {}
    for row in plan.sampled_rows:
        tokens = picked.get(row.request_id)
        if tokens is None:
            continue
        if len(tokens) != len(row.proposals) + 1:
            raise MalformedBatch(f"{len(tokens)} picked tokens for a block of {len(row.proposals) + 1} rows")
        if not row.proposals:
            out[row.request_id] = SampleResult(tokens[0])
            continue
        n = 0
        while n < len(row.proposals) and tokens[n] == row.proposals[n]:
            n += 1
        out[row.request_id] = [SampleResult(t) for t in tokens[: n + 1]]
    return out


def wants(plan: StepPlan, best: bool) -> dict[str, Want]:
    """What a pass asks of the engine for its sampled rows beside their logits: a greedy row's tokens, picked where
    its logits are (`pickable`), and where the engine takes them (`best`: `Engine.takes_best`) a top-k row's
    candidates, or a greedy one's whose bias and penalties only lower logits (`Draw.of`, a row with no proposals
    to verify, which reads every row's distribution): shards/engines/picks.py."""
    out: dict[str, Want] = {}
    for row in plan.sampled_rows:
        params = row.sample.params
        if params.pickable:
            out[row.request_id] = True
        elif best and not row.proposals and (draw := Draw.of(params, _window(row.sample))) is not None:
            out[row.request_id] = draw
    return out


def _window(sample) -> tuple[int, ...]:
    """The penalties' window of a sampled row's state, as the plan froze it (empty where nothing is penalized)."""
    return tuple(sample.state.window(sample.params)) if sample.params.penalized else ()


def refusal(item: SampleItem) -> str | None:
    """Why the item's logits can't be sampled, or None: a [vocab] row, or [k+1, vocab] with k drafts, of floats
    with no NaN and no +inf."""
    logits = item.logits
    if (
        not isinstance(logits, np.ndarray)
        or logits.ndim != (2 if item.drafts else 1)
        or (item.drafts and len(logits) != len(item.drafts) + 1)
        or logits.size == 0
        or logits.dtype.kind != "f"
        or not _no_nan_or_posinf(logits)
    ):
        return (
            f"request {item.request_id}: logits must be a non-empty finite float vector (a row for each of "
            "[t, d1..dk] with drafts)"
        )
    return None


def _no_nan_or_posinf(logits: np.ndarray) -> bool:
    """No NaN and no +inf (-inf is a masked token): the maximum propagates NaN and is +inf when any value is, in
    one pass with no temporary [vocab] mask."""
    top = logits.max()
    return not (np.isnan(top) or top == np.inf)
