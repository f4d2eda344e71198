"""A fetching node's copy of a model: the model's own files, holding only the pieces fetched and verified so far.

Each weights file is created at its full size as a *sparse* file and only the pieces fetched are written into it;
the holes cost no disk and are never read, because the loaders map the file and read only the tensors of the
shards this node serves (and those are served only once their pieces are all here). So the existing GGUF and
safetensors loaders work on the copy unchanged, and fetching more layers later just fills more of it. Small files
(config, tokenizer) are written whole, via a temporary file renamed into place.

What is verified is recorded in `.exo-fetch.json` (piece indices, as runs, and each piece's sha256 as the node
holding the original file stated it) beside the manifest it refers to (`.exo-fetch-manifest.json`): a piece's
bytes are written and fsynced before the record that names them is replaced (write a temporary file, fsync,
rename), so after a crash or a kill the record never claims a piece that isn't on disk, and a restart fetches only
what is missing.

Weights are checked at rest, not only in transit: a reused copy's pieces are hashed again when it is loaded, and
a piece whose bytes no longer match the source's digest (a flipped block on disk, an edit by hand) is dropped and
fetched again, never loaded or served on. The digests a copy hands to other fetching peers are the recorded ones,
never recomputed from its own, possibly damaged, bytes (node/fetch/source.py checks them before each upload).

With a cluster key the manifest recorded is the signed one (node/fetch/seal.py), and its digests are the ones
that count: a reused copy whose manifest does not verify under the key (edited, signed under another key, or
fetched without one) is not reused but fetched again, and a recorded digest that differs from the signed one
drops its piece.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from pathlib import Path

from node.core.topology import Availability
from node.fetch.hashes import hash_range
from node.fetch.manifest import METADATA, Manifest, ManifestError
from node.fetch.seal import ManifestSeal

log = logging.getLogger(__name__)
STATE, MANIFEST = ".exo-fetch.json", ".exo-fetch-manifest.json"


class DiskError(OSError):
    """The models folder can't take the copy: full, not writable, or otherwise failing. Says what to do."""


def disk_error(e: OSError, what: str, folder: Path) -> DiskError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskError(
            f"disk full: cannot write {what} in {folder} ({_free_mb(folder)} MB free); free some space "
            "or choose another --models-dir"
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return DiskError(f"cannot write {what} in {folder}: {e.strerror}; choose a writable --models-dir")
    return DiskError(f"cannot write {what} in {folder}: {e.strerror or e}")


def _free_mb(folder: Path) -> str:
    try:
        st = os.statvfs(folder)
        return f"{st.f_bavail * st.f_frsize / 1e6:.1f}"
    except OSError:
        return "?"


class LocalCopy:
    def __init__(self, root: Path, manifest: Manifest, verified: bytearray, digests: dict[int, bytes] | None = None):
        self.root, self.manifest, self._verified = root, manifest, verified
        self._digests = digests if digests is not None else {}  # piece -> the source's sha256, for each verified
        self.damaged_at_rest = 0  # pieces found damaged on disk (at load or before an upload) and dropped
        self._lock = threading.Lock()  # pieces are written from worker threads; the record is shared
        # Bumped by every write: a value computed while a write landed is recomputed, never kept stale.
        self._version = 0
        self._availability: tuple[int, Availability] | None = None
        self._by_label: dict[tuple[str, int], list[int]] = {}
        for i, p in enumerate(manifest.pieces):
            self._by_label.setdefault(("metadata", -1) if p.part in METADATA else (p.part, p.layer), []).append(i)

    # -- opening ----------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, root: Path, seal: ManifestSeal | None = None) -> LocalCopy | None:
        """The copy in `root` as a previous run left it, its held pieces hashed again (disk work: call it off the
        event loop), or None when there is none (or it is unusable). A piece recorded without the source's digest
        (a record of an older version) counts as missing: nothing is trusted that can't be checked. With `seal`
        (a cluster key) the recorded manifest must verify, and a piece is kept only with its signed digest."""
        try:
            manifest = Manifest.from_json(json.loads((root / MANIFEST).read_text()))
            if seal is not None:
                seal.verify(manifest)
            state = json.loads((root / STATE).read_text())
            verified = bytearray(len(manifest.pieces))
            for start, end in state["verified"]:
                verified[start:end] = b"\1" * (end - start)
            if len(verified) != len(manifest.pieces):
                raise ValueError("verified pieces beyond the manifest")
            digests = _digests(state.get("sha256", {}), len(manifest.pieces))
            for i in range(len(verified)):
                if i not in digests or (manifest.signed and digests[i] != manifest.sha256[i]):
                    verified[i] = 0
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, ManifestError) as e:
            log.warning("ignoring the damaged fetch record in %s (%s): fetching again", root, e)
            return None
        copy = cls(root, manifest, verified, digests)
        copy._drop_lost()
        copy._check_at_rest()
        return copy

    @classmethod
    def create(cls, root: Path, manifest: Manifest, seal: ManifestSeal | None = None) -> LocalCopy:
        """The copy of `manifest` in `root`: the one already there when it is of the same model layout (and, with
        `seal`, its manifest verifies), else a fresh one (what was there is removed)."""
        old = cls.load(root, seal)
        if old is not None and old.manifest.fingerprint == manifest.fingerprint:
            return old
        try:
            root.mkdir(parents=True, exist_ok=True)
            stale = _old_files(root)
            if stale:
                log.warning(
                    "the copy of %s in %s is damaged or of another layout than the peers' model: starting over",
                    manifest.model_id,
                    root,
                )
            for name in stale:
                (root / name).unlink(missing_ok=True)
            copy = cls(root, manifest, bytearray(len(manifest.pieces)))
            _atomic_write(root / MANIFEST, json.dumps(manifest.to_json()).encode())
            copy._save()
        except OSError as e:
            raise disk_error(e, "the model's copy", root) from None
        return copy

    def _drop_lost(self) -> None:
        """Forget pieces of files that are gone or have the wrong size (deleted or replaced by hand)."""
        for index, f in enumerate(self.manifest.files):
            try:
                intact = (self.root / f.name).stat().st_size == f.size
            except OSError:
                intact = False
            if not intact:
                for i, p in enumerate(self.manifest.pieces):
                    if p.file == index:
                        self._verified[i] = 0

    def _check_at_rest(self) -> None:
        """Hash every held piece again; drop the ones whose bytes are not what the source stated."""
        dropped = [i for i in range(len(self._verified)) if self._verified[i] and not self.intact(i)]
        for i in dropped:
            self._drop(i, "when the copy was opened")
        if dropped:
            self._save()

    def intact(self, index: int) -> bool:
        """Whether piece `index` is held and its bytes on disk still have the source's digest (reads the piece)."""
        digest = self._digests.get(index)
        if not self._verified[index] or digest is None:
            return False
        p = self.manifest.pieces[index]
        try:
            return hash_range(self.root / self.manifest.files[p.file].name, p.offset, p.length) == digest
        except OSError:
            return False

    def damaged(self, index: int) -> None:
        """Piece `index` was found damaged (before an upload): drop it, so that it is fetched again."""
        with self._lock:
            if self._verified[index]:
                self._drop(index, "before it was served to a peer")
                self._save()

    def _drop(self, index: int, when: str) -> None:
        p = self.manifest.pieces[index]
        what = f"layer {p.layer}" if p.part == "layer" else p.part
        log.warning(
            "piece %d of %s (%s, %d bytes in %s) does not match its sha256 %s: dropped, it will be fetched again",
            index,
            self.manifest.model_id,
            what,
            p.length,
            self.manifest.files[p.file].name,
            when,
        )
        self._verified[index] = 0
        self._digests.pop(index, None)
        self._version += 1
        self.damaged_at_rest += 1

    # -- what is here -----------------------------------------------------------------------------------------
    def digest(self, index: int) -> bytes | None:
        """The sha256 the source stated for piece `index`, when this copy holds it."""
        return self._digests.get(index) if self._verified[index] else None

    def has(self, index: int) -> bool:
        return bool(self._verified[index])

    def missing(self, indices: list[int]) -> list[int]:
        return [i for i in indices if not self._verified[i]]

    @property
    def complete(self) -> bool:
        return all(self._verified)

    @property
    def has_metadata(self) -> bool:
        return all(self._verified[i] for i in self._by_label.get(("metadata", -1), []))

    def availability(self) -> Availability:
        """What this copy lets the node serve (recomputed only after a piece was added)."""
        version = self._version
        if self._availability is None or self._availability[0] != version:
            self._availability = (version, self._compute_availability())
        return self._availability[1]

    def _compute_availability(self) -> Availability:
        if self.complete:
            return Availability()
        if not self.has_metadata:
            return Availability(complete=False)

        def ready(part: str, layer: int = -1) -> bool:
            pieces = self._by_label.get((part, layer))
            return pieces is not None and all(self._verified[i] for i in pieces)

        runs: list[tuple[int, int]] = []
        for layer in range(self.manifest.n_layers):
            if not ready("layer", layer):
                continue
            if runs and runs[-1][1] == layer:
                runs[-1] = (runs[-1][0], layer + 1)
            else:
                runs.append((layer, layer + 1))
        head = ready("norm") and (ready("head") if ("head", -1) in self._by_label else ready("embed"))
        return Availability(complete=False, layers=tuple(runs), embed=ready("embed"), head=head)

    def check_space(self, indices: list[int]) -> None:
        """Refuse up front, with a clear error, a fetch the disk has no room for."""
        need = self.manifest.nbytes(self.missing(indices))
        try:
            st = os.statvfs(self.root)
        except OSError as e:
            raise disk_error(e, "the model's copy", self.root) from None
        if st.f_bavail * st.f_frsize < need:
            raise DiskError(
                f"disk full: {self.root} has {st.f_bavail * st.f_frsize / 1e6:.1f} MB free, the pieces "
                f"to fetch need {need / 1e6:.1f} MB; free some space or choose another --models-dir"
            )

    # -- adding pieces (called from worker threads) ------------------------------------------------------------
    def write(self, index: int, data: bytes, digest: bytes) -> None:
        """Store a verified piece, durably, then record it with `digest`: the sha256 its source stated (and the
        bytes were checked against)."""
        if len(digest) != 32:
            raise ValueError(f"piece {index}: a sha256 digest has 32 bytes, got {len(digest)}")
        if self.manifest.signed and digest != self.manifest.sha256[index]:
            raise ValueError(f"piece {index}: the digest differs from the signed manifest's")
        piece = self.manifest.pieces[index]
        f = self.manifest.files[piece.file]
        if len(data) != piece.length:
            raise ValueError(f"piece {index} has {piece.length} bytes, got {len(data)}")
        path = self.root / f.name
        try:
            if piece.part == "file":
                _atomic_write(path, data)
            else:
                self._write_range(path, f.size, piece.offset, data)
            with self._lock:
                self._verified[index] = 1
                self._digests[index] = digest
                self._version += 1
                self._save()
        except OSError as e:
            raise disk_error(e, f"{f.name}", self.root) from None

    def _write_range(self, path: Path, size: int, offset: int, data: bytes) -> None:
        # O_NOFOLLOW: a link planted in the models folder can't redirect the write elsewhere.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # the full size, as a hole: blocks are allocated only where pieces land
            view = memoryview(data)
            while view:
                view = view[os.pwrite(fd, view, offset + len(data) - len(view)) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def _save(self) -> None:
        runs, start = [], None
        for i, v in enumerate([*self._verified, 0]):
            if v and start is None:
                start = i
            elif not v and start is not None:
                runs.append([start, i])
                start = None
        digests = {str(i): d.hex() for i, d in sorted(self._digests.items()) if self._verified[i]}
        _atomic_write(self.root / STATE, json.dumps({"version": 2, "verified": runs, "sha256": digests}).encode())


def _digests(raw: object, n: int) -> dict[int, bytes]:
    """The record's digests, each checked: a piece index in range and 64 hex digits, or the record is damaged."""
    if not isinstance(raw, dict):
        raise ValueError("sha256 is not a mapping")
    out = {}
    for k, v in raw.items():
        if not (isinstance(k, str) and k.isdigit() and int(k) < n and isinstance(v, str) and len(v) == 64):
            raise ValueError(f"bad sha256 entry {str(k)[:20]!r}")
        out[int(k)] = bytes.fromhex(v)
    return out


def _old_files(root: Path) -> list[str]:
    """The files an earlier copy in `root` was made of, as far as its manifest can still tell."""
    try:
        return [f.name for f in Manifest.from_json(json.loads((root / MANIFEST).read_text())).files]
    except (OSError, ValueError, ManifestError):
        return []


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)
