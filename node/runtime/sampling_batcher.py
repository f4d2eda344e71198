"""The last shard's sampling batcher: collect up to `max_batch` logits rows or `window` seconds, sample once.

Rows that can share one call (same engine kind, model revision, vocab size and dtype) are sampled together on the
engine thread (node/runtime/sample_rows.py: one batched call, or each row alone as the fallback, every result
validated before anyone is resolved). A pass's rows are sampled right where the pass ran (`sample_step`); rows
that come any other way queue here (`submit`) until the batch is full or the window ends.

Constrained rows (a grammar in their SamplingParams) share the call: their rows of the stacked logits are masked
first (a masked copy; the mask was computed on the grammar thread while the forward pass ran), and each sampled
token is then fed to the request's matcher, which starts computing the next mask at once. A request whose
grammar fails (it can't be built, or rejects a token) fails alone.

Rows with proposals (speculative decoding: node/core/speculation.py) are blocks of k+1 rows [t, d1..dk]: they are
verified together and resolve to the list of tokens to emit, the accepted drafts and the token after them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from node.core.step_plan import StepPlan
from node.runtime.sample_rows import Counts, SampleItem, picked_results, refusal, sample_rows, verify
from shards.decoding.grammar import GrammarTokenizer, Matcher
from shards.decoding.sampling import SampleResult, sample_best
from shards.engines.base import Engine
from shards.engines.picks import Best, host_pick

log = logging.getLogger(__name__)
__all__ = ["BatcherClosed", "SampleItem", "SamplingBatcher"]


class BatcherClosed(RuntimeError):
    """The batcher shut down before this item was sampled."""


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
        self._grammar_pool: ThreadPoolExecutor | None = None  # builds the view, computes masks
        self._grammar_asked = False

    # -- producer side ----------------------------------------------------------------------------------------
    def submit(self, item: SampleItem) -> asyncio.Future:
        """Queue one row (or a block of rows with drafts); the future resolves to its SampleResult, or for a block
        to the list of results to emit (or to the error that only this request hit)."""
        if self._closed:
            raise BatcherClosed("the sampling batcher is shut down")
        if (why := refusal(item)) is not None:
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

    def expect_grammar(self) -> None:
        """A pass about to run samples a constrained row: start building llguidance's view of the vocabulary (19 MB
        for a 32k vocabulary, more for larger; built once) beside it, on the grammar thread, so the pass's sampling,
        on the engine thread, waits at most for what is left of it, once. Built at start instead, every node held
        it, used or not."""
        if self._grammar is not None and not self._grammar_asked:
            self._grammar_asked = True
            self._grammars().submit(self._grammar)  # a failure is raised again where the row is sampled

    def _grammars(self) -> ThreadPoolExecutor:
        if self._grammar_pool is None:
            self._grammar_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        return self._grammar_pool

    def sample_now(self, items: list[SampleItem]) -> tuple[dict[str, SampleResult | list | BaseException], list]:
        """On the executor's thread, right after the forward pass that made the items' logits: sample them in
        batches of at most `max_batch`, as `submit` then `flush` would, without the two more trips between the
        event loop and the engine thread those take (every token of every request: docs/benchmarks.md, one stream).
        Items `submit` would refuse are left out: they take that path, which refuses them. Returns the results by
        request and what to give `record` on the loop."""
        items = [i for i in items if refusal(i) is None]
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
        self,
        engine: Engine,
        plan: StepPlan,
        outputs: Mapping[str, np.ndarray | None],
        picked: Mapping[str, tuple[int, ...]],
        drawn: Mapping[str, Best],
    ) -> tuple[dict[str, SampleResult | list | BaseException], list]:
        """On the engine thread, right after `plan`'s pass: its rows to sample (`Row.sample`: the parameters and
        sampler states the plan froze), from their logits (the last row, or every row of one with proposals), in
        `sample_now`'s batches, and the rows whose greedy token the engine picked where their logits were
        (`picked`, shards/engines/picks.py: their outputs are None), counted as one batch of their own, and the
        top-k rows whose candidates it took (`drawn`: the same draw as from their logits), one more. A row whose
        output is missing (refused) is not sampled; one whose logits can't be sampled is left to the core, which
        asks for it through `submit` and fails it with the reason."""
        results, batches = self.sample_now(self._items(engine, plan, outputs))
        if picked:
            counts = Counts()
            counts["sample_picked"] = len(picked)
            results.update(picked_results(plan, picked))
            batches.append((len(picked), [(len(picked), counts)]))
        if drawn:
            counts = Counts()
            for row in plan.sampled_rows:
                if (best := drawn.get(row.request_id)) is None:
                    continue
                try:
                    results[row.request_id] = sample_best(best.ids, best.values, row.sample.params, row.sample.state)
                    counts["sample_drawn"] += 1
                except Exception as e:  # only this request fails
                    counts["sample_errors"] += 1
                    results[row.request_id] = e
            batches.append((len(drawn), [(len(drawn), counts)]))
        return results, batches

    def _items(self, engine: Engine, plan: StepPlan, outputs: Mapping[str, np.ndarray | None]) -> list[SampleItem]:
        items = []
        for row in plan.sampled_rows:
            out = outputs.get(row.request_id)
            if row.sample is None or not (isinstance(out, np.ndarray) and out.ndim == 2 and len(out)):
                continue
            logits = out if row.proposals else out[-1]
            params, state = row.sample.params, row.sample.state
            items.append(SampleItem(row.request_id, logits, params, state, engine, plan.shard.model_id, row.proposals))
        return items

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

    def _count_group(self, size: int, counts: Counts) -> None:
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

    def _sample_group(self, items: list[SampleItem]) -> tuple[list[SampleResult | BaseException], Counts]:
        """On the executor's thread: sample one group, counting what happened (the loop adds the counts)."""
        counts = Counts()
        results: list[SampleResult | BaseException | None] = [None] * len(items)
        blocks = [k for k, item in enumerate(items) if item.drafts]
        for k, verified in zip(blocks, verify([items[k] for k in blocks], self.batching, counts)):
            results[k] = verified
        rows: list[SampleItem] = []
        for k, item in enumerate(items):
            if item.drafts:
                continue
            try:
                if (allowed := self._allowed_pick(item)) is not None:
                    results[k] = allowed
                    counts["sample_grammar_picked"] += 1
                else:
                    rows.append(self._masked(item))
            except Exception as e:  # the grammar can't be built or allows nothing: only this request fails
                counts["sample_grammar_errors"] += 1
                results[k] = e
        sampled = iter(sample_rows(rows, self.batching, counts))
        for k, item in enumerate(items):
            if item.drafts or isinstance(results[k], BaseException):
                continue
            result = results[k] = next(sampled) if results[k] is None else results[k]
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
        if item.params.constraint is None:
            return item
        return dataclasses.replace(item, logits=self._matcher(item).apply(item.logits))

    def _matcher(self, item: SampleItem) -> Matcher:
        if item.state.matcher is None:
            if self._grammar is None:
                raise ValueError("this node cannot sample constrained requests (no grammar tokenizer)")
            item.state.matcher = Matcher(self._grammar(), item.params.constraint, self._grammars())
        return item.state.matcher

    def _allowed_pick(self, item: SampleItem) -> SampleResult | None:
        """A greedy constrained row's token without masking its logits, or None: its argmax where that is single
        (shards/engines/picks.py) and its grammar allows it, which makes it the masked row's single maximum too, the
        token masking then sampling would give. A model that follows its grammar mostly gets here."""
        if item.params.constraint is None or not item.params.plain_greedy:
            return None
        pick = host_pick(item.logits)
        if pick.tokens is None:
            return None
        token, allowed = pick.tokens[0], self._matcher(item).mask()
        return SampleResult(token) if token < allowed.size and allowed[token] else None
