"""What a model consists of, in pieces a peer can fetch one by one.

A piece is a byte range of one of the model's files: a small file whole (config.json, tokenizer.json ...), the
header of a weights file (GGUF metadata and tensor table; a safetensors JSON header), or the bytes of one tensor
(a big tensor in blocks of at most `MAX_PIECE`, so an interrupted fetch loses at most one block). Each is labelled
with what it is for: `layer` pieces belong to one transformer layer, `embed`/`norm`/`head` to the first or last
shard, and everything else (`file`, `header`, `other`) is metadata every node fetches.

A manifest comes from a peer, so it is hostile until checked: `Manifest.__post_init__` validates everything
(plain file names only, pieces inside their files, in order, without overlap, of bounded size) and raises
`ManifestError` otherwise. Everything that builds one, from the wire or from disk, goes through it.

With a cluster key a manifest also carries each piece's sha256 (of the original file's bytes), the id of the node
that stated them and an HMAC over both under the cluster key (node/fetch/seal.py): what a fetched copy checks its
pieces against, on arrival, at every restart and before it serves one on.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from shards.model.shard import Shard

MAX_PIECE = 64 << 20  # the most bytes one piece may have: what a fetching node holds in memory per piece in flight
MAX_FILES = 256
MAX_PIECES = 1 << 20
MAX_FILE_BYTES = 1 << 50
MAX_LAYERS = 4096
FORMATS = ("gguf", "safetensors")
METADATA = ("file", "header", "other")  # parts every node fetches, whatever its layers
PARTS = (*METADATA, "layer", "embed", "norm", "head")
MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # also a folder name in the models dir
FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")  # no '/', no leading '.': never a path elsewhere
SIGNER = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")  # a node id (node/security/peer.py's NODE_ID)


SLOWEST_LINK = 16_000  # bytes per second a piece's transfer is given time for, on both ends


def piece_deadline(length: int) -> float:
    """Seconds a piece of `length` bytes may take to go over: the fetcher's call deadline and the server's limit
    on how long one transfer holds an upload slot (a caller that stops reading can't hold it forever)."""
    return 60 + length / SLOWEST_LINK


class ManifestError(ValueError):
    """A manifest is malformed or describes something a node must not write."""


@dataclass(frozen=True)
class ModelFile:
    name: str  # a plain file name inside the model's folder
    size: int


@dataclass(frozen=True)
class Piece:
    file: int  # index into Manifest.files
    offset: int
    length: int
    part: str  # one of PARTS
    layer: int = -1  # part "layer": which one

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class Manifest:
    model_id: str
    format: str  # "gguf" (one .gguf file) or "safetensors" (a Hugging Face folder)
    n_layers: int
    files: tuple[ModelFile, ...]
    pieces: tuple[Piece, ...]  # ordered by (file, offset)
    sha256: tuple[bytes, ...] = ()  # signed: each piece's sha256, in piece order; unsigned: none
    signer: str = ""  # signed: the node id that stated the digests
    signature: bytes = b""  # signed: HMAC-SHA256 of `signed_bytes()` under the cluster key's manifest key

    def __post_init__(self) -> None:
        _check(self)

    # -- which pieces a node needs ----------------------------------------------------------------------------
    def metadata(self) -> list[int]:
        """Pieces every node needs before it can even start: config, tokenizer, headers (and unlabelled tensors,
        which are small and which a loader might read)."""
        return [i for i, p in enumerate(self.pieces) if p.part in METADATA]

    def parts(self, shard: Shard) -> set[str]:
        """Which of embed/norm/head a shard needs. A tied model has no head: its last shard reads the embedding."""
        wanted = {"embed"} if shard.is_first else set()
        if shard.is_last:
            wanted |= {"norm", "head" if any(p.part == "head" for p in self.pieces) else "embed"}
        return wanted

    def needed(self, shard: Shard) -> list[int]:
        """The pieces a node must hold to serve `shard` (its layers, the embedding/norm/head it needs, and the
        metadata)."""
        parts = self.parts(shard)
        return [
            i
            for i, p in enumerate(self.pieces)
            if p.part in METADATA
            or p.part in parts
            or (p.part == "layer" and shard.start_layer <= p.layer < shard.end_layer)
        ]

    def nbytes(self, indices: list[int] | None = None) -> int:
        return sum(self.pieces[i].length for i in (range(len(self.pieces)) if indices is None else indices))

    # -- identity and storage ---------------------------------------------------------------------------------
    @property
    def signed(self) -> bool:
        return bool(self.signature)

    def to_json(self) -> dict:
        signed = {"signer": self.signer, "signature": self.signature.hex()} if self.signed else {}
        return {**self._content(), **signed}

    def _content(self) -> dict:
        """What the manifest says about the model: its layout and, when signed, the pieces' digests."""
        return {
            "model_id": self.model_id,
            "format": self.format,
            "n_layers": self.n_layers,
            "files": [[f.name, f.size] for f in self.files],
            "pieces": [[p.file, p.offset, p.length, p.part, p.layer] for p in self.pieces],
            **({"sha256": [d.hex() for d in self.sha256]} if self.sha256 else {}),
        }

    @classmethod
    def from_json(cls, raw: object) -> Manifest:
        try:
            return cls(
                raw["model_id"],
                raw["format"],
                raw["n_layers"],  # type: ignore[index]
                tuple(ModelFile(name, size) for name, size in raw["files"]),  # type: ignore[index]
                tuple(Piece(*p) for p in raw["pieces"]),  # type: ignore[index]
                tuple(bytes.fromhex(d) for d in raw.get("sha256", ())),  # type: ignore[union-attr]
                raw.get("signer", ""),  # type: ignore[union-attr]
                bytes.fromhex(raw.get("signature", "")),  # type: ignore[union-attr]
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"not a manifest ({type(e).__name__}: {e})") from None

    def signed_bytes(self) -> bytes:
        """What a signature covers: the layout, every piece's digest and the signer, under a version label (so a
        signature made for anything else never verifies as a manifest's)."""
        body = {**self._content(), "signer": self.signer}
        return b"exo-node manifest v1\n" + json.dumps(body, separators=(",", ":")).encode()

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identifies the layout and, when signed, the bytes: a fetching node only mixes pieces from peers whose
        manifests agree. Not the signer's id: copies of one file signed by different nodes agree."""
        return hashlib.sha256(json.dumps(self._content(), separators=(",", ":")).encode()).hexdigest()


def same_layout(a: Manifest, b: Manifest) -> bool:
    """Whether two manifests describe the same files with the same bytes labelled the same way, however their
    tensors were split into blocks."""
    return (a.format, a.n_layers, a.files) == (b.format, b.n_layers, b.files) and _runs(a) == _runs(b)


def _runs(m: Manifest) -> list[tuple[int, int, int, str, int]]:
    """Contiguous pieces with the same label, merged: (file, start, end, part, layer)."""
    runs: list[tuple[int, int, int, str, int]] = []
    for p in m.pieces:
        if (
            runs
            and runs[-1][0] == p.file
            and runs[-1][2] == p.offset
            and runs[-1][3:] == (p.part, p.layer)
            and p.part not in ("file", "header")
        ):
            runs[-1] = (p.file, runs[-1][1], p.end, p.part, p.layer)
        else:
            runs.append((p.file, p.offset, p.end, p.part, p.layer))
    return runs


def _check(m: Manifest) -> None:
    def fail(why: str) -> None:
        raise ManifestError(f"manifest of {m.model_id[:128]!r}: {why}")

    if not isinstance(m.model_id, str) or not MODEL_ID.match(m.model_id):
        raise ManifestError(f"model id {str(m.model_id)[:64]!r} is not 1-128 characters of [A-Za-z0-9._-]")
    if m.format not in FORMATS:
        fail(f"unknown format {str(m.format)[:32]!r}")
    if not _int(m.n_layers) or not 1 <= m.n_layers <= MAX_LAYERS:
        fail(f"n_layers must be 1-{MAX_LAYERS}")
    if not 1 <= len(m.files) <= MAX_FILES or not 1 <= len(m.pieces) <= MAX_PIECES:
        fail(f"needs 1-{MAX_FILES} files and 1-{MAX_PIECES} pieces")
    names = set()
    for f in m.files:
        if not isinstance(f.name, str) or not FILE_NAME.match(f.name):
            fail(f"file name {str(f.name)[:64]!r} is not a plain file name")
        if f.name.lower() in names:
            fail(f"file {f.name!r} is listed twice")
        names.add(f.name.lower())
        if not _int(f.size) or not 0 <= f.size <= MAX_FILE_BYTES:
            fail(f"file {f.name!r} has an impossible size")
    if m.format == "gguf" and not _gguf_files(m.files):
        fail("a GGUF model is one .gguf file, or the NAME-0000k-of-0000N.gguf parts of one split model, in order")
    if m.format == "safetensors" and "config.json" not in names:
        fail("a safetensors model needs a config.json")
    previous: Piece | None = None
    for p in m.pieces:
        if not all(_int(v) for v in (p.file, p.offset, p.length, p.layer)) or p.part not in PARTS:
            fail(f"malformed piece {p!r}"[:200])
        if not 0 <= p.file < len(m.files):
            fail(f"a piece names file {p.file} of {len(m.files)}")
        size, name = m.files[p.file].size, m.files[p.file].name
        if p.offset < 0 or not 0 <= p.length <= MAX_PIECE or p.end > size:
            fail(f"piece {p.offset}+{p.length} of {name!r} lies outside its {size} bytes or exceeds {MAX_PIECE}")
        if p.length == 0 and p.part != "file":
            fail(f"empty piece at {p.offset} of {name!r}")
        if (p.part == "layer") != (0 <= p.layer < m.n_layers) or (p.part != "layer" and p.layer != -1):
            fail(f"piece at {p.offset} of {name!r}: part {p.part} with layer {p.layer}")
        if p.part == "file" and (p.offset, p.length) != (0, size):
            fail(f"{name!r} is fetched whole, but its piece covers {p.offset}+{p.length} of {size} bytes")
        first_of_file = previous is None or previous.file != p.file
        if first_of_file:
            if previous is not None and p.file < previous.file:
                fail("pieces are not in file order")
            if p.part not in ("file", "header") or p.offset != 0:
                fail(f"{name!r} does not start with its header")
        elif p.part in ("file", "header") or p.offset < previous.end:
            fail(f"pieces of {name!r} overlap, are out of order or repeat its header")
        previous = p
    listed = {p.file for p in m.pieces}
    if listed != set(range(len(m.files))):
        fail("a file has no pieces")
    layers = {p.layer for p in m.pieces if p.part == "layer"}
    if len(layers) != m.n_layers:
        fail(f"layers {sorted(set(range(m.n_layers)) - layers)[:8]} have no pieces")
    if not any(p.part == "embed" for p in m.pieces) or not any(p.part == "norm" for p in m.pieces):
        fail("no embedding or final norm")
    _check_signed(m, fail)


def _check_signed(m: Manifest, fail: Callable[[str], None]) -> None:
    """Digests, signer and signature all present, well formed and one digest per piece, or none of them."""
    if not (m.sha256 or m.signer or m.signature):
        return
    if not isinstance(m.sha256, tuple) or len(m.sha256) != len(m.pieces):
        fail(f"{len(m.sha256) if isinstance(m.sha256, tuple) else '?'} digests for {len(m.pieces)} pieces")
    if not all(isinstance(d, bytes) and len(d) == 32 for d in m.sha256):
        fail("a piece's digest is not 32 bytes")
    if not isinstance(m.signer, str) or not SIGNER.match(m.signer):
        fail(f"signer {str(m.signer)[:64]!r} is not a node id")
    if not isinstance(m.signature, bytes) or len(m.signature) != 32:
        fail("the signature is not 32 bytes (HMAC-SHA256)")


_SPLIT_PART = re.compile(r"^(?P<prefix>.+)-00001-of-(?P<count>\d{5})\.gguf$")  # shards.formats.gguf_file.SPLIT_NAME


def _gguf_files(files: tuple[ModelFile, ...]) -> bool:
    """One .gguf file, or every part of one split model in order (llama.cpp's `%s-%05d-of-%05d.gguf` names)."""
    if len(files) == 1:
        return files[0].name.lower().endswith(".gguf")
    m = _SPLIT_PART.match(files[0].name)
    return (
        bool(m)
        and int(m.group("count")) == len(files)
        and all(f.name == f"{m.group('prefix')}-{i:05d}-of-{len(files):05d}.gguf" for i, f in enumerate(files, 1))
    )


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
