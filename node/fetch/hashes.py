"""The sha256 of each piece a node serves, computed the first time someone asks for it and remembered.

Hashing a multi-GB model up front would delay every start by minutes, and most pieces are wanted by one peer at
most, so each piece is hashed on its first request (in a thread: reading and hashing a piece is disk and CPU work the event loop must not wait on) and kept
in memory and in a small JSON file per model file under the cache folder, keyed by the file's path, size and
modification time: a restarted node states the same hashes without reading the file again, and a changed file
starts a fresh record. The cache file is optional: when it can't be written, hashes are only kept in memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)
SAVE_EVERY_S = 2.0


class HashCache:
    def __init__(self, folder: Path | None):
        self.folder = folder
        self._files: dict[Path, _FileHashes] = {}
        self._pending: dict[tuple[Path, int, int], asyncio.Future] = {}
        self._warned = False

    async def sha256(self, path: Path, offset: int, length: int) -> bytes:
        record = self._record(path)
        key = f"{offset}:{length}"
        if (known := record.hashes.get(key)) is not None:
            return bytes.fromhex(known)
        pending_key = (path, offset, length)
        if (pending := self._pending.get(pending_key)) is None:  # two askers at once: hash once
            pending = self._pending[pending_key] = asyncio.ensure_future(
                asyncio.to_thread(hash_range, path, offset, length)
            )
        try:
            digest = await asyncio.shield(pending)
        finally:
            if pending.done():
                self._pending.pop(pending_key, None)
        record.hashes[key] = digest.hex()
        if time.monotonic() - record.saved > SAVE_EVERY_S:
            self._save(record)
        else:
            record.dirty = True
        return digest

    def close(self) -> None:
        for record in self._files.values():
            if record.dirty:
                self._save(record)

    def _record(self, path: Path) -> _FileHashes:
        st = path.stat()
        record = self._files.get(path)
        if record is None or (record.size, record.mtime_ns) != (st.st_size, st.st_mtime_ns):
            record = self._files[path] = _FileHashes(path, st.st_size, st.st_mtime_ns, self._load(path, st))
        return record

    def _cache_file(self, path: Path) -> Path | None:
        if self.folder is None:
            return None
        return self.folder / (hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32] + ".json")

    def _load(self, path: Path, st: os.stat_result) -> dict[str, str]:
        cache = self._cache_file(path)
        try:
            raw = json.loads(cache.read_text()) if cache is not None else None
        except (OSError, ValueError):
            return {}  # no cache yet, or a damaged one: hash again
        if (
            not isinstance(raw, dict)
            or [raw.get("path"), raw.get("size"), raw.get("mtime_ns")]
            != [str(path.resolve()), st.st_size, st.st_mtime_ns]
            or not isinstance(raw.get("hashes"), dict)
        ):
            return {}
        return {
            k: v
            for k, v in raw["hashes"].items()
            if isinstance(k, str) and isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)
        }

    def _save(self, record: _FileHashes) -> None:
        record.saved, record.dirty = time.monotonic(), False
        cache = self._cache_file(record.path)
        if cache is None:
            return
        body = {
            "path": str(record.path.resolve()),
            "size": record.size,
            "mtime_ns": record.mtime_ns,
            "hashes": record.hashes,
        }
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(body))
            os.replace(tmp, cache)
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning(
                    "cannot keep piece hashes in %s (%s): they will be computed again after a restart",
                    cache.parent,
                    e.strerror or e,
                )


class _FileHashes:
    def __init__(self, path: Path, size: int, mtime_ns: int, hashes: dict[str, str]):
        self.path, self.size, self.mtime_ns, self.hashes = path, size, mtime_ns, hashes
        self.saved, self.dirty = 0.0, False


def hash_range(path: Path, offset: int, length: int, block: int = 1 << 20) -> bytes:
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < length:
            data = os.pread(fd, min(block, length - done), offset + done)
            if not data:
                raise OSError(f"{path} ends before byte {offset + length}")
            digest.update(data)
            done += len(data)
    finally:
        os.close(fd)
    return digest.digest()
