"""Engines for the shards a node has been assigned, loaded on demand, once, and the one thread that runs them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from shards.engines.base import Engine, EngineInputError, StepInput
from shards.formats.config import ModelConfig
from shards.model.shard import Shard

log = logging.getLogger(__name__)

EngineFactory = Callable[[Path, Shard, ModelConfig], Engine]


class ShardManager:
    """Owns the engines and the single thread that runs them.

    Every engine call (load, validate, forward, sample, release) runs on one thread, in submission order: KV caches
    are not thread-safe, and a release queued after a forward can never be overtaken by it.
    """

    def __init__(self, model_dir: Path, config: ModelConfig, factory: EngineFactory):
        self.model_dir, self.config, self.factory = model_dir, config, factory
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.engines: dict[Shard, Engine] = {}
        self._loading: dict[Shard, asyncio.Future] = {}

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def get(self, shard: Shard) -> Engine:
        engine = self.engines.get(shard)
        if engine is not None:
            return engine
        pending = self._loading.get(shard)
        if pending is None:  # first asker loads; concurrent askers await the same future
            pending = self._loading[shard] = asyncio.ensure_future(self._load(shard))
        try:
            return await asyncio.shield(pending)
        finally:
            if pending.done():
                self._loading.pop(shard, None)

    async def _load(self, shard: Shard) -> Engine:
        # Free idle engines of other shards first so a reassignment doesn't need twice the memory.
        for old in [s for s, e in self.engines.items() if s != shard and e.active_requests == 0]:
            log.info("unloading %s", old)
            del self.engines[old]
        log.info("loading %s", shard)
        engine = await self.run(self.factory, self.model_dir, shard, self.config)
        self.engines[shard] = engine
        return engine

    async def forward(
        self,
        engine: Engine,
        inputs: list[tuple[str, np.ndarray, int]],
        reuse: dict[str, tuple[str, int]] | None = None,
        retain_limit: int = 0,
        *,
        starts: dict[str, int] | None = None,
        every_row: frozenset[str] = frozenset(),
        then: Callable[[dict[str, np.ndarray]], None] | None = None,
    ) -> tuple[dict[str, np.ndarray], dict[str, str], float]:
        """One forward pass over (request id, input, most positions it will reach): outputs per request, the
        requests whose input the engine refused (with why), which are left out of the pass instead of failing it,
        and the seconds the engine computed (on its thread: no queueing or event-loop time in it).

        `reuse`: requests that start from a retained prefix, (finished request, positions); one whose prefix this
        engine no longer holds is refused with a reason that starts with PREFIX_GONE. `retain_limit`: bytes the
        engine's retained caches may hold now (what reservations leave free); it frees the least recently used first.
        `starts`: requests whose cache is first rolled back to that position (speculation: the previous step's
        rejected proposals); one the engine refuses is refused like a bad input. `every_row`: requests whose
        logits the last shard returns for every row, not only the last (their proposals are verified). `then`:
        called with the outputs on the engine thread right after the pass (the pipeline samples there), never
        raising."""
        return await self.run(_forward, engine, inputs, reuse or {}, retain_limit, starts or {}, every_row, then)

    def release(self, request_id: str, keep: bool = False) -> None:
        """Queue the release of a request's caches in every engine (after any forward already queued); `keep`: a
        finished request's caches are retained for prefix reuse by engines that can (BlockEngine.retain)."""
        for engine in list(self.engines.values()):
            retain = getattr(engine, "retain", None) if keep else None
            self.executor.submit(retain or engine.release, request_id)

    def retained_evictions(self) -> int:
        """Retained caches freed for room so far, over every engine."""
        return sum(e.retained.evictions for e in list(self.engines.values()) if hasattr(e, "retained"))

    def retained_bytes(self) -> int:
        """Memory held by finished requests' retained caches (a snapshot: the engine thread changes them)."""
        return sum(e.retained.nbytes for e in list(self.engines.values()) if hasattr(e, "retained"))

    @property
    def active_requests(self) -> int:
        return sum(e.active_requests for e in self.engines.values())

    @property
    def loaded(self) -> tuple[Shard, ...]:
        return tuple(self.engines)

    def cache_bytes(self) -> int:
        """Bytes held by every KV cache of the engines. The engine thread adds and drops caches meanwhile; a dict
        that changes while it is summed raises, and the next try gets a consistent view."""
        total = 0
        for engine in list(self.engines.values()):
            measure = getattr(engine, "cache_bytes", None)
            for _ in range(5):
                try:
                    total += measure() if measure else 0
                    break
                except RuntimeError:
                    continue
        return total

    def weights_bytes(self) -> int:
        """Bytes held by the loaded weights."""
        return sum(e.nbytes() for e in list(self.engines.values()))

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


PREFIX_GONE = "prefix gone"  # how a refusal for an evicted retained prefix starts (the entry then prefills it all)


def _forward(
    engine: Engine,
    inputs: list[tuple[str, np.ndarray, int]],
    reuse: dict[str, tuple[str, int]],
    retain_limit: int,
    starts: dict[str, int],
    every_row: frozenset[str],
    then: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, str], float]:
    started = time.perf_counter()
    items, refused = [], {}
    retained = getattr(engine, "retained", None)
    if retained is not None:
        retained.limit = retain_limit
        retained.shrink(retain_limit)
    for rid, data, positions in inputs:
        if rid in reuse and engine.cache_length(rid) == 0:  # its first step here: start from the retained prefix
            entry_id, count = reuse[rid]
            if retained is None or not engine.resume(rid, entry_id, count):
                refused[rid] = (
                    f"{PREFIX_GONE}: {engine.shard} no longer holds the first {count} positions of {entry_id}"
                )
                continue
        item = (
            StepInput(rid, tokens=data, max_positions=positions)
            if engine.shard.is_first
            else StepInput(rid, hidden=data, max_positions=positions)
        )
        try:
            if rid in starts:
                engine.rollback(rid, starts[rid])
            engine.validate([item])
            items.append(item)
        except EngineInputError as e:
            refused[rid] = str(e)
    outputs = _outputs(engine, items, every_row)
    computed = time.perf_counter() - started
    if then is not None:
        then(outputs)
    return outputs, refused, computed


def _outputs(engine: Engine, items: list[StepInput], every_row: frozenset[str]) -> dict[str, np.ndarray]:
    """One engine call for the step, or on a last shard with inputs to verify, one call returning every row's
    logits for them and the decode rows (a decode row's one row is its last), and one for the prompt chunks, whose
    rows but the last nobody needs (a head over 256 rows is costly)."""
    whole = [i for i in items if i.request_id in every_row or i.length == 1] if engine.shard.is_last else []
    if not any(i.request_id in every_row for i in whole):
        whole = []
    rest = [i for i in items if i.request_id not in {w.request_id for w in whole}]
    outputs = dict(zip((i.request_id for i in whole), engine.forward(whole, all_logits=True) if whole else []))
    outputs |= dict(zip((i.request_id for i in rest), engine.forward(rest) if rest else []))
    return outputs
