"""The serving side of fetching: a node that has the model hands out its manifest and any of its pieces.

Only what the manifest lists can be asked for, by piece index (never a path or an arbitrary range), and only the
model this node serves. Who may ask is settled before any of this: with a cluster key, only callers holding it
complete the TLS handshake (as for every RPC); without one gRPC listens on loopback unless told otherwise.

A node serving weights also serves requests, so uploads are bounded: at most `max_transfers` pieces stream at once
(further asks are refused as busy and retried by the fetching node, possibly elsewhere), and with `rate` set all
uploads together stay under that many bytes per second (a token bucket, shared).

With a cluster key (`seal`) the manifest served states every piece's sha256 and is signed (node/fetch/seal.py): the
first ask hashes the whole model once (in a thread; the digests are cached on disk across restarts), and an ask
that comes while that runs longer than `SIGN_WAIT_S` is refused with how far it got, so the fetcher asks again.
A fetched copy serves the signed manifest it received, unchanged.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from node.core.failures import busy
from node.fetch.hashes import HashCache
from node.fetch.layout import DEFAULT_PIECE, LayoutError, build_manifest, model_root
from node.fetch.local_copy import LocalCopy
from node.fetch.manifest import Manifest
from node.fetch.seal import ManifestSeal

CHUNK = 1 << 20  # bytes per streamed message (far below gRPC's message limit; bounds each message's memory)
MIN_CHUNK = 16 << 10
SIGN_WAIT_S = 10.0  # how long a manifest ask waits for the hashing that signing needs (the fetcher's limit is 30 s)


class FetchRefused(ValueError):
    """The ask names something this node doesn't serve (another model, no such piece, weights not complete)."""


class TokenBucket:
    """At most `rate` bytes per second on average, in bursts of at most `burst` bytes. Callers that would exceed it
    wait; concurrent callers share the rate."""

    def __init__(self, rate: float | None, burst: int = CHUNK, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self._free_at = 0.0  # when the bucket would be full again given what was taken so far

    async def take(self, n: int) -> None:
        if not self.rate:
            return
        now = self.clock()
        self._free_at = max(self._free_at, now - self.burst / self.rate) + n / self.rate
        wait = self._free_at - now
        if wait > 0:
            await asyncio.sleep(wait)


@dataclass
class Transfer:
    """One piece on its way out: its stated sha256 and length, and its bytes in chunks. `close()` frees its
    upload slot, however the stream ended (always call it)."""

    sha256: bytes
    length: int
    chunks: AsyncIterator[bytes]
    release: Callable[[], None]
    closed: bool = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.release()


class WeightSource:
    def __init__(
        self,
        path: Path,
        model_id: str,
        n_layers: int,
        *,
        cache_dir: Path | None = None,
        rate: float | None = None,
        max_transfers: int = 4,
        chunk: int = CHUNK,
        max_piece: int = DEFAULT_PIECE,
        ready: Callable[[], bool] = lambda: True,
        manifest: Manifest | None = None,
        copy: LocalCopy | None = None,
        seal: ManifestSeal | None = None,
    ):
        """`rate`: bytes per second for all uploads together (None: unlimited). `ready`: whether the weights are
        all here (a node that fetched its copy serves it once it is complete); `manifest`: the one to serve
        instead of building it from the files (a fetched copy's); `copy`: that fetched copy, whose pieces are
        served with the digests their source stated, each checked against the bytes on disk first; `seal`: with a
        cluster key, signs the manifest of the model's own files."""
        self.path, self.model_id, self.n_layers, self.max_piece = path, model_id, n_layers, max_piece
        self.root = model_root(path)
        self.ready, self._manifest, self.copy, self.seal = ready, manifest, copy, seal
        self._signing: asyncio.Task | None = None
        self._hashed = 0  # pieces hashed so far for the signature
        self.hashes = HashCache(cache_dir)
        # Chunks small enough that a slow cap still sends one every ~quarter second (the receiver's idle timeout
        # must never fire on a healthy, throttled stream).
        self.chunk = min(chunk, max(MIN_CHUNK, int(rate / 4))) if rate else chunk
        self.bucket = TokenBucket(rate, burst=self.chunk)
        self.max_transfers = max_transfers
        self.active = 0
        self.counters: Counter[str] = Counter()
        self._sizes: dict[str, tuple[int, int]] = {}

    async def manifest(self, model_id: str) -> Manifest:
        if model_id != self.model_id:
            raise FetchRefused(f"this node serves {self.model_id!r}, not {model_id[:128]!r}")
        if not self.ready():
            raise FetchRefused(f"this node does not hold all of {self.model_id!r} yet")
        if self._manifest is None:
            try:  # reads headers only; a GGUF's is parsed once per process and cached
                self._manifest = await asyncio.to_thread(
                    build_manifest, self.path, self.model_id, self.n_layers, self.max_piece
                )
            except LayoutError as e:
                raise FetchRefused(f"cannot describe {self.model_id!r}: {e}") from None
        if self.seal is not None and not self._manifest.signed and self.copy is None:
            self._manifest = await self._signed(self._manifest)
        return self._manifest

    async def _signed(self, manifest: Manifest) -> Manifest:
        """`manifest` with every piece's digest, signed; hashing runs once, whoever asks and however often."""
        if self._signing is None:
            self._signing = asyncio.ensure_future(self._sign(manifest))
        done, _ = await asyncio.wait([self._signing], timeout=SIGN_WAIT_S)
        if not done:
            raise FetchRefused(
                f"hashing {self.model_id!r} to sign its manifest ({self._hashed} of {len(manifest.pieces)} pieces): "
                "ask again shortly"
            )
        try:
            return self._signing.result()
        except OSError as e:  # a read error may pass: hash again on the next ask
            self._signing = None
            raise FetchRefused(f"cannot hash {self.model_id!r} to sign its manifest: {e.strerror or e}") from None

    async def _sign(self, manifest: Manifest) -> Manifest:
        digests = []
        for p in manifest.pieces:
            path = self.root / manifest.files[p.file].name
            self._check_unchanged(path, manifest.files[p.file].size)
            digests.append(await self.hashes.sha256(path, p.offset, p.length))
            self._hashed += 1
        return self.seal.sign(manifest, tuple(digests))

    async def open(self, model_id: str, index: int) -> Transfer:
        """A piece to stream; raises FetchRefused, or a busy Failed when every upload slot is taken. The upload
        slot is held until the transfer is closed."""
        manifest = await self.manifest(model_id)
        if not 0 <= index < len(manifest.pieces):
            raise FetchRefused(f"{model_id!r} has pieces 0-{len(manifest.pieces) - 1}, not {index}")
        if self.active >= self.max_transfers:
            self.counters["upload_busy"] += 1
            raise busy(f"all {self.max_transfers} upload slots are in use")
        piece = manifest.pieces[index]
        path = self.root / manifest.files[piece.file].name
        self.active += 1
        try:
            self._check_unchanged(path, manifest.files[piece.file].size)
            digest = await self._digest(index, path, piece.offset, piece.length)
        except BaseException:
            self.active -= 1
            raise
        return Transfer(digest, piece.length, self._chunks(path, piece.offset, piece.length), self._release)

    async def _digest(self, index: int, path: Path, offset: int, length: int) -> bytes:
        """The piece's sha256 as its source stated it: a fetched copy's recorded digest, once the bytes on disk are
        shown to still have it (a damaged piece is dropped from the copy and refused, never served on); the
        original file's own, hashed once and remembered."""
        if self.copy is None:
            digest = await self.hashes.sha256(path, offset, length)
            signed = self._manifest.sha256 if self._manifest is not None else ()
            if signed and signed[index] != digest:
                raise FetchRefused(f"piece {index} of {self.model_id!r} changed since its manifest was signed")
            return digest
        stated = self.copy.digest(index)
        if stated is None or not await asyncio.to_thread(self.copy.intact, index):
            self.copy.damaged(index)
            self.counters["upload_damaged"] += 1
            raise FetchRefused(f"piece {index} of {self.model_id!r} is damaged on this node; it is fetched again")
        return stated

    def _release(self) -> None:
        self.active -= 1

    def _check_unchanged(self, path: Path, size: int) -> None:
        try:
            st = path.stat()
        except OSError as e:
            raise FetchRefused(f"{path.name} is unreadable ({e.strerror})") from None
        first = self._sizes.setdefault(path.name, (st.st_size, st.st_mtime_ns))
        if st.st_size != size or (st.st_size, st.st_mtime_ns) != first:
            raise FetchRefused(f"{path.name} changed on disk since this node started; restart it to serve the new one")

    async def _chunks(self, path: Path, offset: int, length: int) -> AsyncIterator[bytes]:
        fd = os.open(path, os.O_RDONLY)
        try:
            sent = 0
            while sent < length:
                n = min(self.chunk, length - sent)
                await self.bucket.take(n)
                data = await asyncio.to_thread(os.pread, fd, n, offset + sent)
                if len(data) != n:
                    raise FetchRefused(f"{path.name} ends early")
                sent += n
                self.counters["upload_bytes"] += n
                yield data
            self.counters["upload_pieces"] += 1
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._signing is not None and not self._signing.done():
            self._signing.cancel()
        self.hashes.close()
