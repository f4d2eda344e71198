"""The last shard's sampling batcher: collect up to `max_batch` logits rows or `window` seconds, sample once.

Rows that can share one call (same engine kind, model revision, vocab size and dtype) are stacked and given to the
engine's batched sampler in one call. The result is validated before anyone is resolved; when the rows cannot be
batched (an engine without a batched sampler) or the batched call raises or returns something malformed, each
affected request is sampled on its own instead (the fallback), which is counted and logged. Sampler RNG states are
rewound before a fallback, so a seeded request gets the same token on every path.

Constrained rows (a grammar in their SamplingParams) share the call: their rows of the stacked logits are masked
first (a masked copy; the mask was computed on the grammar thread while the forward pass ran), and each sampled
token is then fed to the request's matcher, which starts computing the next mask at once. A request whose
grammar fails (it can't be built, or rejects a token) fails alone.

Rows with proposals (speculative decoding: node/core/speculation.py) are blocks of k+1 rows [t, d1..dk]: they are
verified together (shards.decoding.speculation.verify_blocks, position by position through the engine's batched sampler)
and resolve to the list of tokens to emit, the accepted drafts and the token after them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from node.core.step_plan import StepPlan
from shards.decoding.grammar import GrammarTokenizer, Matcher
from shards.decoding.sampling import SampleResult, SamplerState, SamplingParams
from shards.decoding.speculation import verify_blocks
from shards.engines.base import Engine

log = logging.getLogger(__name__)


class BatcherClosed(RuntimeError):
    """The batcher shut down before this item was sampled."""


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


@dataclass
class _Pending:
    item: SampleItem
    future: asyncio.Future = field(repr=False)


class SamplingBatcher:
    """Batches rows and samples them on `executor`: the node passes its engine thread, where every engine call runs.
    Counters are only touched on the event loop."""

    def __init__(
        self,
        max_batch: int = 8,
        window_ms: float = 5.0,
        executor: Executor | None = None,
        grammar: Callable[[], GrammarTokenizer] | None = None,
    ):
        """`grammar`: the model's vocabulary for llguidance (built on first use); without it constrained requests
        fail with a reason."""
        if max_batch < 1 or window_ms < 0:
            raise ValueError("max_batch must be >= 1 and window_ms >= 0")
        self.max_batch, self.window = max_batch, window_ms / 1000.0
        self.batching = max_batch > 1 and window_ms > 0
        self.stats: Counter[str] = Counter()
        self._pending: list[_Pending] = []
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._tasks: set[asyncio.Task] = set()
        # Sampling runs off the event loop, so the loop keeps serving RPCs meanwhile.
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="sampler")
        self._grammar = grammar
        self._grammar_pool: ThreadPoolExecutor | None = None  # computes masks; started by the first constraint

    # -- producer side ----------------------------------------------------------------------------------------
    def submit(self, item: SampleItem) -> asyncio.Future:
        """Queue one row (or a block of rows with drafts); the future resolves to its SampleResult, or for a block
        to the list of results to emit (or to the error that only this request hit)."""
        if self._closed:
            raise BatcherClosed("the sampling batcher is shut down")
        if (why := _refusal(item)) is not None:
            raise ValueError(why)
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(item, future))
        self.stats["sample_items"] += 1
        if not self.batching or len(self._pending) >= self.max_batch:
            self.flush()
        elif self._timer is None:  # the window starts with the batch's first item
            self._timer = asyncio.get_running_loop().call_later(self.window, self.flush)
        return future

    def flush(self) -> None:
        """Close the current batch now (full batch, window elapsed, or the producer knows nothing else is coming)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch = [p for p in self._pending if not p.future.done()]  # cancelled waiters drop out here
        self._pending = []
        if batch:
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop: waiters still queued get BatcherClosed; batches already running finish."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for p in self._pending:
            if not p.future.done():
                p.future.set_exception(BatcherClosed("the sampling batcher shut down before this row was sampled"))
        self._pending = []
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._grammar_pool is not None:
            self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    # -- a pass's rows, sampled where the pass ran -------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def sample_now(self, items: list[SampleItem]) -> tuple[dict[str, SampleResult | list | BaseException], list]:
        """On the executor's thread, right after the forward pass that made the items' logits: sample them in
        batches of at most `max_batch`, as `submit` then `flush` would, without the two more trips between the
        event loop and the engine thread those take (every token of every request: docs/benchmarks.md, one stream).
        Items `submit` would refuse are left out: they take that path, which refuses them. Returns the results by
        request and what to give `record` on the loop."""
        items = [i for i in items if _refusal(i) is None]
        results: dict[str, SampleResult | list | BaseException] = {}
        batches = []
        for at in range(0, len(items), self.max_batch):
            batch = items[at : at + self.max_batch]
            groups: dict[tuple, list[SampleItem]] = defaultdict(list)
            for item in batch:
                groups[item.group_key].append(item)
            counted = []
            for group in groups.values():
                out, counts = self._sample_group(group)
                results.update((item.request_id, r) for item, r in zip(group, out))
                counted.append((len(group), counts))
            batches.append((len(batch), counted))
        return results, batches

    def sample_step(
        self, engine: Engine, plan: StepPlan, outputs: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, SampleResult | list | BaseException], list]:
        """On the engine thread, right after `plan`'s pass: its rows to sample (`Row.sample`: the parameters and
        sampler states the plan froze), from their logits (the last row, or every row of one with proposals), in
        `sample_now`'s batches. A row whose output is missing (refused) is not sampled; one whose logits can't be
        sampled is left to the core, which asks for it through `submit` and fails it with the reason."""
        items = []
        for row in plan.sampled_rows:
            out = outputs.get(row.request_id)
            if row.sample is None or not (isinstance(out, np.ndarray) and out.ndim == 2 and len(out)):
                continue
            logits = out if row.proposals else out[-1]
            params, state = row.sample.params, row.sample.state
            items.append(SampleItem(row.request_id, logits, params, state, engine, plan.shard.model_id, row.proposals))
        return self.sample_now(items)

    def record(self, batches: list) -> None:
        """On the loop: count the batches `sample_now` sampled."""
        for size, counted in batches:
            self.stats["sample_items"] += size
            self._count_batch(size)
            for n, counts in counted:
                self._count_group(n, counts)

    # -- the sampling ----------------------------------------------------------------------------------------
    def _count_batch(self, size: int) -> None:
        self.stats["sample_batches"] += 1
        self.stats[f"sample_batch_size_{size}"] += 1

    def _count_group(self, size: int, counts: _Counts) -> None:
        self.stats.update(counts)
        for item, reason in counts.fallbacks:
            log.info(
                "sampling fallback for %d rows (engine %s, vocab %d): %s",
                size,
                item.engine.name,
                item.logits.shape[-1],
                reason,
            )  # metadata only: never logits or text

    async def _run(self, batch: list[_Pending]) -> None:
        groups: dict[tuple, list[_Pending]] = defaultdict(list)
        for p in batch:
            groups[p.item.group_key].append(p)
        self._count_batch(len(batch))
        loop = asyncio.get_running_loop()
        for group in groups.values():
            results, counts = await loop.run_in_executor(self._executor, self._sample_group, [p.item for p in group])
            self._count_group(len(group), counts)
            for p, result in zip(group, results):
                if p.future.done():
                    continue  # cancelled while we sampled; nobody waits for it
                if isinstance(result, BaseException):
                    p.future.set_exception(result)
                else:
                    p.future.set_result(result)

    def _sample_group(self, items: list[SampleItem]) -> tuple[list[SampleResult | BaseException], _Counts]:
        """On the executor's thread: sample one group, counting what happened (the loop adds the counts)."""
        counts = _Counts()
        results: list[SampleResult | BaseException | None] = [None] * len(items)
        blocks = [k for k, item in enumerate(items) if item.drafts]
        for k, verified in zip(blocks, _verify([items[k] for k in blocks], self.batching, counts)):
            results[k] = verified
        rows: list[SampleItem] = []
        for k, item in enumerate(items):
            if item.drafts:
                continue
            try:
                rows.append(self._masked(item))
            except Exception as e:  # the grammar can't be built or allows nothing: only this request fails
                counts["sample_grammar_errors"] += 1
                results[k] = e
        sampled = iter(self._sample_rows(rows, counts))
        for k, item in enumerate(items):
            if results[k] is not None or item.drafts:
                continue
            result = results[k] = next(sampled)
            if item.params.constraint is not None and isinstance(result, SampleResult):
                counts["sample_constrained"] += 1
                try:
                    item.state.matcher.advance(result.token)
                except Exception as e:
                    counts["sample_grammar_errors"] += 1
                    results[k] = e
        return results, counts

    def _masked(self, item: SampleItem) -> SampleItem:
        """The item itself, or for a constrained request a copy whose logits only allow what its grammar allows."""
        constraint = item.params.constraint
        if constraint is None:
            return item
        if item.state.matcher is None:
            if self._grammar is None:
                raise ValueError("this node cannot sample constrained requests (no grammar tokenizer)")
            if self._grammar_pool is None:
                self._grammar_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
            item.state.matcher = Matcher(self._grammar(), constraint, self._grammar_pool)
        return dataclasses.replace(item, logits=item.state.matcher.apply(item.logits))

    def _sample_rows(self, items: list[SampleItem], counts: _Counts) -> list[SampleResult | BaseException]:
        if not items:
            return []
        engine = items[0].engine
        if self.batching and len(items) > 1 and engine.batched_sampling:
            snapshots = [i.state.snapshot() for i in items]
            try:
                results = engine.sample(
                    np.stack([i.logits for i in items]), [i.params for i in items], [i.state for i in items]
                )
                _validate(results, items)
                counts["sample_calls"] += 1
                return results
            except Exception as e:
                for item, snap in zip(items, snapshots):
                    item.state.restore(snap)
                counts.fallback(items, f"batched sampler failed: {type(e).__name__}")
        elif len(items) > 1:
            counts.fallback(items, "engine has no batched sampler" if self.batching else "batching disabled")
        return [_sample_alone(item, counts) for item in items]


class _Counts(Counter):
    def __init__(self):
        super().__init__()
        self.fallbacks: list[tuple[SampleItem, str]] = []

    def fallback(self, items: list[SampleItem], reason: str) -> None:
        self["sample_fallbacks"] += len(items)
        self.fallbacks.append((items[0], reason))


def _verify(items: list[SampleItem], batching: bool, counts: _Counts) -> list[list[SampleResult] | BaseException]:
    """The blocks of rows with proposals: verified in one go through the engine's batched sampler, or, when that
    can't be or fails, each alone (sampler states rewound first, so the tokens are the same either way)."""
    if not items:
        return []
    engine = items[0].engine
    if batching and len(items) > 1 and engine.batched_sampling:
        snapshots = [i.state.snapshot() for i in items]
        try:
            results = verify_blocks(
                np.concatenate([i.logits for i in items]),
                [i.drafts for i in items],
                [i.params for i in items],
                [i.state for i in items],
                sample=engine.sample,
            )
            for item, block in zip(items, results):
                _validate_block(block, item)
            counts["sample_verify_calls"] += 1
            return results
        except Exception as e:
            for item, snap in zip(items, snapshots):
                item.state.restore(snap)
            counts.fallback(items, f"batched verification failed: {type(e).__name__}")
    out: list[list[SampleResult] | BaseException] = []
    for item in items:
        sample = _row_by_row(engine)  # the fallback: as plain rows fall back to sample_one
        try:
            block = verify_blocks(item.logits, [item.drafts], [item.params], [item.state], sample=sample)[0]
            _validate_block(block, item)
            counts["sample_verify_calls"] += 1
            out.append(block)
        except Exception as e:  # only this request fails
            counts["sample_errors"] += 1
            log.warning("verifying proposals failed for request %s: %s", item.request_id, type(e).__name__)
            out.append(e)
    return out


def _row_by_row(engine: Engine) -> Callable[..., list[SampleResult]]:
    """An engine without a batched sampler samples each row on its own."""
    return lambda rows, params, states: [engine.sample_one(r, p, s) for r, p, s in zip(rows, params, states)]


def _validate_block(block: object, item: SampleItem) -> None:
    """1..k+1 valid results whose all but the last repeat the drafts (the accepted ones)."""
    if not isinstance(block, list) or not 1 <= len(block) <= len(item.drafts) + 1:
        raise MalformedBatch(f"expected 1 to {len(item.drafts) + 1} results, got {type(block).__name__}")
    row = dataclasses.replace(item, logits=item.logits[0], drafts=())
    _validate(block, [row] * len(block))
    if [r.token for r in block[:-1]] != list(item.drafts[: len(block) - 1]):
        raise MalformedBatch("the accepted tokens are not the drafts")


def _sample_alone(item: SampleItem, counts: _Counts) -> SampleResult | BaseException:
    try:
        result = item.engine.sample_one(item.logits, item.params, item.state)
        _validate([result], [item])
        counts["sample_calls"] += 1
        return result
    except Exception as e:  # only this request fails
        counts["sample_errors"] += 1
        log.warning("sampling failed for request %s: %s", item.request_id, type(e).__name__)
        return e


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


def _refusal(item: SampleItem) -> str | None:
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
    """No NaN and no +inf (-inf is a masked token): the maximum propagates NaN and is +inf when any value is. One
    pass with no temporary array, where isnan().any() and isposinf().any() took two passes and two [vocab] masks
    for every row of every step."""
    top = logits.max()
    return not (np.isnan(top) or top == np.inf)
