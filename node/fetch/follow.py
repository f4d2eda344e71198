"""Keeps a fetching node holding the layers the cluster assigns it.

Every node computes the same target ring over all members (node/core/placement/ring.py); this node's part of it is its
target. When the target needs pieces the copy lacks, they are fetched; when the target changes (a node joins or
leaves) the fetch in progress stops (what it verified stays) and the new target's pieces are fetched. A target
must hold still for `settle` seconds first, so nodes joining one after the other don't start a fetch per join.
Until a node holds its target layers, plans leave it out (readiness), and its topology entry says how far it got.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from typing import Protocol

from node.core.placement.partition import PartitionError
from node.core.placement.ring import target_ring
from node.core.topology import Availability, NodeInfo
from node.fetch.fetcher import Fetcher, FetchError
from node.fetch.local_copy import DiskError, LocalCopy
from shards.model.shard import Shard

log = logging.getLogger(__name__)
RETRY_S = (5.0, 60.0)  # after a failed fetch: first wait, longest wait


class RingView(Protocol):
    """What the follower reads of its node (node/runtime/node.py): who it is, and who a ring may hold."""

    @property
    def id(self) -> str: ...

    @property
    def model_id(self) -> str: ...

    @property
    def draining(self) -> bool: ...

    def ring_members(self) -> list[NodeInfo]:
        """The node itself (unless it drains) and the peers serving the same model."""
        ...

    @property
    def layer_costs(self) -> tuple[int, ...] | None:
        """Each layer's size for placement by bytes (None: by layer count), as the node plans with."""
        ...


class Follower:
    """Made before its node, whose `availability` it is (the node's constructor takes it); run with the node once
    that exists."""

    def __init__(
        self, copy: LocalCopy, fetcher: Fetcher, counters: Counter[str], *, settle: float = 2.0, interval: float = 0.25
    ):
        self.copy, self.fetcher, self.counters = copy, fetcher, counters
        self.settle, self.interval = settle, interval
        self.note = ""
        self._job: asyncio.Task | None = None
        self._job_target: Shard | None = None
        self._retry_at, self._retry_wait = 0.0, RETRY_S[0]

    def availability(self) -> Availability:
        """The layers this node can serve now, with how far its fetch got (what its topology entry shows)."""
        a = self.copy.availability()
        return a if a.complete else dataclasses.replace(a, note=self.note)

    def target(self, node: RingView) -> Shard | None:
        """This node's part of the ring the cluster is meant to have (None: no part, e.g. more nodes than layers)."""
        if node.draining:
            return None
        try:  # the copy's layer count is the model's (checked at start-up, node/cli.py)
            ring = target_ring(node.ring_members(), node.model_id, self.copy.manifest.n_layers, node.layer_costs)
            return dict(ring).get(node.id)
        except PartitionError:
            return None

    async def run(self, node: RingView) -> None:
        seen, since = None, time.monotonic()
        try:
            while True:
                target = self.target(node)
                now = time.monotonic()
                if target != seen:
                    seen, since = target, now
                if self._job is not None and self._job.done():
                    self._finished(self._job)
                if self._job is not None and self._job_target != target:
                    log.info("target changed from %s to %s: stopping its fetch", self._job_target, target)
                    await self._stop_job()
                wanted = target is not None and not self.copy.availability().can_serve(target)
                if self._job is None and wanted and now - since >= self.settle and now >= self._retry_at:
                    self._start(target)
                self._update_note(target)
                await asyncio.sleep(self.interval)
        finally:
            await self._stop_job()

    def _start(self, target: Shard) -> None:
        indices = self.copy.manifest.needed(target)
        self.counters["fetch_bytes_needed"] = self.copy.manifest.nbytes(self.copy.missing(indices))
        what = _describe(target)
        log.info("fetching %s of %s (%.1f MB)", what, target.model_id, self.counters["fetch_bytes_needed"] / 1e6)
        self._job_target = target
        self._job = asyncio.ensure_future(self._fetch(indices, f"fetching {target.model_id} {what}"))

    async def _fetch(self, indices: list[int], desc: str) -> None:
        started = time.monotonic()
        self.counters["fetch_active"] = 1
        try:
            await self.fetcher.fetch(self.copy, indices, desc)
        finally:
            self.counters["fetch_active"] = 0
            self.counters["fetch_ms"] += int((time.monotonic() - started) * 1000)

    def _finished(self, job: asyncio.Task) -> None:
        self._job = None
        error = None if job.cancelled() else job.exception()
        if error is None:
            self._retry_wait = RETRY_S[0]
            return
        self.counters["fetch_errors"] += 1
        if not isinstance(error, (FetchError, DiskError)):
            log.error("fetching %s failed", self._job_target, exc_info=error)
        else:
            log.error("fetching %s failed: %s (trying again in %.0f s)", self._job_target, error, self._retry_wait)
        self.note = f"error: {error}"[:1000]
        self._retry_at = time.monotonic() + self._retry_wait
        self._retry_wait = min(2 * self._retry_wait, RETRY_S[1])

    async def _stop_job(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)

    def _update_note(self, target: Shard | None) -> None:
        if self._job is not None and target is not None:
            needed = self.counters["fetch_bytes_needed"] or 1
            left = self.copy.manifest.nbytes(self.copy.missing(self.copy.manifest.needed(target)))
            self.note = f"fetching {_describe(target)}: {100 * (1 - left / needed):.0f}%"
        elif not self.note.startswith("error") or (target is not None and self.copy.availability().can_serve(target)):
            self.note = ""


def _describe(shard: Shard) -> str:
    end = shard.end_layer - 1
    return f"layer {end}" if shard.start_layer == end else f"layers {shard.start_layer}-{end}"
