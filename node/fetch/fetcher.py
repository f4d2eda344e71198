"""The fetching side: pieces of a model from the peers that serve it, each verified, into a local copy.

Every piece is checked against the sha256 its peer states before a byte of it is written; a piece that fails the
check is counted, logged and fetched again (from the next peer, when there are several). A peer that is gone, slow
or refusing is skipped for a moment and the piece is asked of another one, so a fetch goes on from another peer when
its peer dies; when no peer is left it waits for one. Peers are only used when their manifest is the one the copy
was started from (the same files, the same pieces), so pieces from different copies never mix.

With a cluster key (`seal`) a peer's manifest is used only when its signature verifies (node/fetch/seal.py); one
that doesn't is refused with an error naming the peer, which is not asked again for a while, and every piece is
checked against the signed manifest's digest, whatever its peer states with it.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from node.core.failures import FailureKind
from node.fetch.local_copy import LocalCopy
from node.fetch.manifest import Manifest
from node.fetch.seal import ManifestSeal, SignatureError
from node.runtime.transport import Transport, TransportError
from shards.formats.progress import Progress

log = logging.getLogger(__name__)
MAX_CORRUPT = 5  # times one piece may fail its check before the fetch is given up (and retried later)
COOL_DOWN_S = 2.0  # a peer that failed a call is not asked again for this long
WAIT_LOG_S = 30.0  # while no peer has the model, say so every this often (the first time after FIRST_WAIT_LOG_S)
FIRST_WAIT_LOG_S = 3.0


class FetchError(RuntimeError):
    """A fetch that can't go on: pieces keep failing their checks, or the peers' model doesn't match."""


@dataclass(frozen=True)
class Source:
    node_id: str
    address: str


class Fetcher:
    def __init__(
        self,
        model_id: str,
        transport: Transport,
        sources: Callable[[], list[Source]],
        *,
        counters: Counter[str] | None = None,
        concurrency: int = 2,
        idle_timeout: float = 30.0,
        seal: ManifestSeal | None = None,
    ):
        """`sources`: the peers that have the whole model right now (asked again whenever one is needed); `seal`:
        with a cluster key, what checks (and, serving, signs) manifests."""
        self.model_id, self.transport, self.sources, self.seal = model_id, transport, sources, seal
        self.counters = Counter() if counters is None else counters
        self.concurrency, self.idle_timeout = concurrency, idle_timeout
        self._fingerprints: dict[str, str] = {}  # source address -> fingerprint of its manifest
        self._cool_until: dict[str, float] = {}
        self._mismatch_warned: set[str] = set()
        self._writes: set[asyncio.Future] = set()  # pieces being written (a thread's work: cancelling can't stop it)

    # -- the manifest -----------------------------------------------------------------------------------------
    async def manifest(self) -> Manifest:
        """The manifest of the first peer that gives one; waits for such a peer."""
        waited = time.monotonic() - WAIT_LOG_S + FIRST_WAIT_LOG_S
        while True:
            for source in self._usable():
                try:
                    manifest = await self._manifest_of(source)
                except TransportError as e:
                    log.info("peer %s has no manifest of %s for us: %s", source.node_id, self.model_id, e)
                    self._cool(source)
                    continue
                if manifest is None or manifest.model_id != self.model_id:
                    self._cool(source)
                    continue
                self._fingerprints[source.address] = manifest.fingerprint
                return manifest
            waited = self._waiting(waited)
            await asyncio.sleep(0.25)

    async def _manifest_of(self, source: Source) -> Manifest | None:
        """The peer's manifest; None, and an error naming the peer, when a cluster key is set and it doesn't
        verify. Raises TransportError."""
        manifest = await self.transport.manifest(source.address, self.model_id)
        if self.seal is None:
            return manifest
        try:
            self.seal.verify(manifest)
        except SignatureError as e:
            self.counters["fetch_bad_manifests"] += 1
            first = source.address not in self._mismatch_warned  # said once per peer, not at every retry
            self._mismatch_warned.add(source.address)
            (log.error if first else log.debug)(
                "peer %s (%s) sent a manifest this node refuses: %s. Not fetching from it; check that it holds "
                "the same cluster key and runs the same exo-node version",
                source.node_id,
                source.address,
                e,
            )
            return None
        return manifest

    def _waiting(self, since: float) -> float:
        """Say (now and then) that we are waiting for a peer; returns when it was last said."""
        if time.monotonic() - since >= WAIT_LOG_S:
            log.warning(
                "waiting for a peer that has all of %s (start one with the model, or check --peers / "
                "discovery and the cluster key)",
                self.model_id,
            )
            return time.monotonic()
        return since

    # -- pieces -----------------------------------------------------------------------------------------------
    async def fetch(self, copy: LocalCopy, indices: list[int], desc: str) -> int:
        """Fetch the pieces of `indices` that `copy` lacks; returns the bytes added. Raises FetchError, DiskError."""
        todo = copy.missing(indices)
        if not todo:
            return 0
        copy.check_space(todo)
        total = copy.manifest.nbytes(todo)
        queue = collections.deque(todo)
        with Progress(desc, total, logger=log) as bar:
            workers = [
                asyncio.ensure_future(self._worker(copy, queue, bar)) for _ in range(min(self.concurrency, len(todo)))
            ]
            try:
                await asyncio.gather(*workers)
            finally:
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                # a fetch ends, even cancelled, only once every piece it began writing has landed and been counted
                await asyncio.gather(*self._writes, return_exceptions=True)
        return total

    async def _worker(self, copy: LocalCopy, queue: collections.deque, bar: Progress) -> None:
        while queue:
            index = queue.popleft()
            await self._piece(copy, index)
            bar.update(copy.manifest.pieces[index].length)

    async def _piece(self, copy: LocalCopy, index: int) -> None:
        piece = copy.manifest.pieces[index]
        corrupt, attempt, waited = 0, 0, time.monotonic() - WAIT_LOG_S + FIRST_WAIT_LOG_S
        while True:
            source = await self._pick(copy.manifest, index + attempt)
            if source is None:
                waited = self._waiting(waited)
                await asyncio.sleep(0.25)
                continue
            attempt += 1
            try:
                stated, data = await self.transport.fetch_piece(
                    source.address, self.model_id, index, piece.length, self._received, self.idle_timeout
                )
            except TransportError as e:
                self.counters["fetch_retries"] += 1
                if e.kind is FailureKind.BUSY:  # its upload slots are full: come back shortly, or try another peer
                    await asyncio.sleep(min(0.05 * attempt, 1.0))
                else:
                    log.info(
                        "piece %d of %s from %s failed (%s): asking again", index, self.model_id, source.node_id, e
                    )
                    self._cool(source)
                continue
            want = copy.manifest.sha256[index] if copy.manifest.signed else stated  # signed: the original's
            if stated != want or await asyncio.to_thread(lambda: hashlib.sha256(data).digest()) != want:
                corrupt += 1
                self.counters["fetch_corrupt_pieces"] += 1
                log.warning(
                    "piece %d of %s (%d bytes) from %s does not match its sha256: refused, fetching it again",
                    index,
                    self.model_id,
                    piece.length,
                    source.node_id,
                )
                if corrupt >= MAX_CORRUPT:
                    raise FetchError(f"piece {index} of {self.model_id} failed its sha256 check {corrupt} times")
                continue
            write = asyncio.ensure_future(asyncio.to_thread(self._store, copy, index, data, want))
            self._writes.add(write)
            write.add_done_callback(self._writes.discard)
            await asyncio.shield(write)
            return

    def _store(self, copy: LocalCopy, index: int, data: bytes, digest: bytes) -> None:
        """Write a verified piece and count it in one thread call, so the counters always match the record."""
        copy.write(index, data, digest)
        self.counters["fetch_pieces"] += 1
        self.counters["fetch_bytes_verified"] += len(data)

    def _received(self, n: int) -> None:
        self.counters["fetch_bytes_received"] += n

    async def _pick(self, manifest: Manifest, turn: int) -> Source | None:
        """A peer whose copy is the one we fetch, taking turns between them so pieces spread over all of them."""
        candidates = self._usable()
        for k in range(len(candidates)):
            source = candidates[(turn + k) % len(candidates)]
            if source.address not in self._fingerprints:
                try:
                    theirs = await self._manifest_of(source)
                except TransportError:
                    theirs = None
                if theirs is None:
                    self._cool(source)
                    continue
                self._fingerprints[source.address] = theirs.fingerprint
            if self._fingerprints[source.address] == manifest.fingerprint:
                return source
            if source.address not in self._mismatch_warned:
                self._mismatch_warned.add(source.address)
                log.warning(
                    "peer %s serves another version of %s (its files differ from the copy being fetched): "
                    "not fetching from it; to fetch its version, delete this node's copy in --models-dir",
                    source.node_id,
                    self.model_id,
                )
        return None

    def _usable(self) -> list[Source]:
        now = time.monotonic()
        return sorted((s for s in self.sources() if self._cool_until.get(s.address, 0) <= now), key=lambda s: s.node_id)

    def _cool(self, source: Source) -> None:
        self._cool_until[source.address] = time.monotonic() + COOL_DOWN_S
        self._fingerprints.pop(source.address, None)  # it may come back as another node
