"""Engines for the shards a node has been assigned, loaded on demand, once, and the one thread that runs them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from node.core.step_plan import StepPlan
from node.runtime.engine_step import Executed, Following, StepSampler, run_pass
from shards.engines.base import Engine
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
        # what ends a run of passes the engine thread goes on with by itself (the pipeline's `Following`), so a
        # call queued behind it never waits for a relayed row's next input (node/runtime/relay.py)
        self.interrupt: Callable[[], None] = lambda: None

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.interrupt()
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

    async def execute(
        self, engine: Engine, plan: StepPlan, sampler: StepSampler | None = None, following: Following | None = None
    ) -> Executed | None:
        """Run one pass (`plan`, node/core/step_plan.py) on the engine thread, and sample its rows there as soon as
        their logits exist (`sampler`: the sampling batcher; None: the rows are left to the batcher's own path).
        One trip to the engine thread and back per pass. Inputs the engine refuses (a bad input, a start it
        won't roll back to, an evicted prefix: a reason that starts with PREFIX_GONE) are left out of the pass,
        not failing it. `following`: the pass is handed to `following.on_pass` straight from the engine thread, in
        the loop callback that ends the trip (its sends go out before the awaiting task resumes), and the plan's
        followed rows run on, pass after pass, each handed on in order (node/runtime/engine_step.py); then this
        returns None once the first was."""
        if following is None:
            return await self.run(run_pass, engine, plan, sampler)
        await following.start(self.executor, engine, plan, sampler)
        return None

    def release(self, request_id: str, keep: bool = False, branch: tuple[str, int] | None = None) -> None:
        """Queue the release of a request's caches in every engine (after any forward already queued); `keep`: a
        finished request's caches are retained for prefix reuse (`Engine.retain`); `branch`: then held as a branch
        of another retained request's (RetainedCaches.branch)."""
        for engine in list(self.engines.values()):
            self.executor.submit(engine.retain if keep else engine.release, request_id)
            if branch is not None:
                self.executor.submit(engine.retained.branch, request_id, *branch)

    def retained_evictions(self) -> int:
        """Retained caches freed for room so far, over every engine."""
        return sum(e.retained.evictions for e in list(self.engines.values()))

    def retained_branches(self) -> int:
        """Retained caches held as branches of another (RetainedCaches.branch), over every engine."""
        return sum(len(e.retained.parents) for e in list(self.engines.values()))

    def retained_bytes(self) -> int:
        """Memory held by finished requests' retained caches (a snapshot: the engine thread changes them)."""
        return sum(e.retained.nbytes for e in list(self.engines.values()))

    @property
    def active_requests(self) -> int:
        return sum(e.active_requests for e in self.engines.values())

    @property
    def loaded(self) -> tuple[Shard, ...]:
        return tuple(self.engines)

    def cache_bytes(self) -> int:
        """Bytes held by every running request's KV cache, over the engines (each sums a snapshot of its caches)."""
        return sum(e.cache_bytes() for e in list(self.engines.values()))

    def weights_bytes(self) -> int:
        """Bytes held by the loaded weights."""
        return sum(e.nbytes() for e in list(self.engines.values()))

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class EngineCalls(Executor):
    """The engine thread for its other callers (the sampling batcher's rows): a call first ends any run of passes
    the engine thread goes on with by itself (`ShardManager.interrupt`), so it never waits behind a relayed row's
    wait for its next input."""

    def __init__(self, shards: ShardManager):
        self.shards = shards

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        self.shards.interrupt()
        return self.shards.executor.submit(fn, *args, **kwargs)


class RetainedStatus:
    """A status source read live: the retained caches' memory, branches and evictions change on the engine thread,
    after the pass that ended their requests (an End from the entry makes a branch)."""

    def __init__(self, shards: ShardManager):
        self.shards = shards

    def items(self) -> list[tuple[str, int]]:
        return [
            ("retained_bytes", self.shards.retained_bytes()),
            ("retained_branches", self.shards.retained_branches()),
            ("prefix_evictions", self.shards.retained_evictions()),
        ]
