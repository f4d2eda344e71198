"""The manifest of a model on disk, from its headers alone (no tensor data is read).

Used by the serving node for the model it serves, and by a fetching node to check, once it holds the headers, that
the manifest it was given labels exactly the tensors its loaders will read (a tensor left out of a layer's pieces
would be read from a hole in the sparse copy, as zeros). Tensor names decide the labels: `blk.N.` (GGUF) and
`model.layers.N.` (Hugging Face) are layer N; the embedding, final norm and output head have one name each.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from node.fetch.manifest import FILE_NAME, Manifest, ManifestError, ModelFile, Piece
from shards.formats.gguf_names import GGUFError
from shards.formats.loader import ModelFormatError, open_model

DEFAULT_PIECE = 8 << 20  # big tensors travel in blocks of this size: what an interruption costs at most
MAX_HEADER = 100 << 20  # safetensors' own limit for its JSON header
# The small files of a Hugging Face folder a node reads (config, tokenizer, chat template); nothing else there
# (READMEs, .bin checkpoints, other formats) is offered.
SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "model.safetensors.index.json",
)
MAX_SMALL_FILE = 64 << 20

_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_GGUF_PARTS = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "head"}
_HF_PARTS = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "head"}


class LayoutError(ValueError):
    """A model on disk whose files can't be described as pieces (unreadable or inconsistent headers)."""


def build_manifest(path: str | Path, model_id: str, n_layers: int, max_piece: int = DEFAULT_PIECE) -> Manifest:
    """The manifest of the model at `path` (a GGUF file, a folder holding one, or a Hugging Face folder)."""
    path = Path(path)
    try:
        source = open_model(path)
        if source.gguf is not None:
            return _manifest(model_id, source.format, n_layers, _gguf_files(source.gguf), max_piece)
        return _manifest(model_id, source.format, n_layers, _hf_files(source.root), max_piece)
    except (GGUFError, ModelFormatError, ManifestError) as e:
        raise LayoutError(str(e)) from None
    except OSError as e:
        raise LayoutError(f"{path}: cannot read ({e.strerror or e})") from None


def model_root(path: str | Path) -> Path:
    """The folder whose files a manifest names."""
    return open_model(path).root


def _manifest(
    model_id: str, fmt: str, n_layers: int, files: list[tuple[Path, list[tuple[str, int, int]] | None]], max_piece: int
) -> Manifest:
    """`files`: (path, tensors as (name, offset, length) with the header ending at the first; None: whole file)."""
    entries, pieces = [], []
    for index, (path, tensors) in enumerate(files):
        size = path.stat().st_size
        if not FILE_NAME.match(path.name):
            raise LayoutError(f"{path}: its name can't be offered to peers (plain [A-Za-z0-9._-] names only)")
        entries.append(ModelFile(path.name, size))
        if tensors is None:
            pieces.append(Piece(index, 0, size, "file"))
            continue
        tensors = sorted(tensors, key=lambda t: t[1])
        header_end = tensors[0][1] if tensors else size
        pieces.append(Piece(index, 0, header_end, "header"))
        for name, offset, length in tensors:
            part, layer = _label(name, fmt, n_layers)
            for start in range(offset, offset + length, max_piece):
                pieces.append(Piece(index, start, min(max_piece, offset + length - start), part, layer))
    return Manifest(model_id, fmt, n_layers, tuple(entries), tuple(pieces))


def _label(name: str, fmt: str, n_layers: int) -> tuple[str, int]:
    m = (_GGUF_LAYER if fmt == "gguf" else _HF_LAYER).match(name)
    if m and int(m.group(1)) < n_layers:
        return "layer", int(m.group(1))
    return (_GGUF_PARTS if fmt == "gguf" else _HF_PARTS).get(name, "other"), -1


def _gguf_files(path: Path) -> list[tuple[Path, list[tuple[str, int, int]]]]:
    """Each file of the GGUF model (a split model: every part, so a fetching node takes every part's header and the
    bytes of its own tensors only, from whichever parts hold them) with its tensors."""
    from shards.formats.gguf_file import open_gguf  # the gguf package (and yaml): only for a GGUF model

    parts = open_gguf(path).parts()  # validates each tensor table: inside its file, no overlaps
    return [(f.path, [(t.name, t.offset, t.nbytes) for t in f.tensors.values()]) for f in parts]


def _hf_files(folder: Path) -> list[tuple[Path, list[tuple[str, int, int]] | None]]:
    out: list[tuple[Path, list[tuple[str, int, int]] | None]] = []
    for name in SMALL_FILES:
        if (folder / name).is_file():
            if (folder / name).stat().st_size > MAX_SMALL_FILE:
                raise LayoutError(f"{folder / name}: larger than {MAX_SMALL_FILE >> 20} MiB")
            out.append((folder / name, None))
    for name in _weight_files(folder):
        out.append((folder / name, safetensors_tensors(folder / name)))
    return out


def _weight_files(folder: Path) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise LayoutError(f"{index}: not a valid safetensors index ({e})") from None
        if not all(isinstance(n, str) and FILE_NAME.match(n) for n in names):
            raise LayoutError(f"{index}: weight files must be plain file names in the model folder")
        return names
    if (folder / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise LayoutError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def safetensors_tensors(path: Path) -> list[tuple[str, int, int]]:
    """(name, absolute offset, length) of every tensor of a safetensors file, from its header, checked against the
    file's size (a sparse local copy has the size of the original)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise LayoutError(f"{path}: truncated safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if not 2 <= n <= min(MAX_HEADER, size - 8):
            raise LayoutError(f"{path}: safetensors header length {n} is impossible for a {size}-byte file")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise LayoutError(f"{path}: safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise LayoutError(f"{path}: safetensors header is not a JSON object")
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise LayoutError(f"{path}: tensor {name!r} has no data_offsets") from None
        if (
            not all(isinstance(v, int) and not isinstance(v, bool) for v in (begin, end))
            or not 0 <= begin <= end <= size - 8 - n
        ):
            raise LayoutError(f"{path}: tensor {name!r} lies outside the file")
        if end > begin:
            tensors.append((name, 8 + n + begin, end - begin))
    spans = sorted((o, o + length, name) for name, o, length in tensors)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise LayoutError(f"{path}: tensors {a!r} and {b!r} overlap")
    return tensors
