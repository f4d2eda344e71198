"""GGUF fixtures (tests/fixtures/gguf, made by make_gguf_reference.py) and ways to damage copies of them."""

from __future__ import annotations

import json
import struct
from functools import cache
from pathlib import Path

import gguf
import numpy as np

from shards.formats.packaged import resolve_model

GGUF_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
GGUF_MODELS = ["llama", "qwen2", "qwen3"]


@cache
def gguf_golden() -> dict:
    return json.loads((GGUF_DIR / "golden.json").read_text())


def fixture(name: str) -> Path:
    return GGUF_DIR / f"{name}.gguf"


@cache
def smollm2_path() -> Path:
    return resolve_model("smollm2")[0]


def rewrite(
    src: Path, dst: Path, drop: tuple[str, ...] = (), replace: dict | None = None, drop_tensors: tuple[str, ...] = ()
) -> Path:
    """Copy a GGUF through gguf's reader and writer, leaving out metadata keys `drop` and tensors `drop_tensors`, and
    overriding `replace` ({key: (value, GGUFValueType[, item type])})."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    _copy(reader, writer, drop, replace or {}, drop_tensors)
    return dst


def patch_tensor_info(
    src: Path, dst: Path, name: str, dims: tuple[int, ...] | None = None, ggml_type: int | None = None
) -> Path:
    """Copy `src` with one tensor's header entry (its dims or its type) overwritten in place."""
    blob = bytearray(src.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = blob.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", blob, at)
    if dims is not None:
        assert len(dims) == n_dims
        struct.pack_into(f"<{n_dims}Q", blob, at + 4, *dims)
    if ggml_type is not None:
        struct.pack_into("<I", blob, at + 4 + 8 * n_dims, ggml_type)
    dst.write_bytes(bytes(blob))
    return dst


def split_gguf(src: Path, folder: Path, max_tensors: int) -> Path:
    """Write `src` as a split model into `folder` the way llama.cpp's gguf-split does (gguf-py's writer, which follows
    it: every metadata key in the first part, split.no/split.count/split.tensors.count in each, at most
    `max_tensors` tensors a part, `NAME-0000k-of-0000N.gguf`); returns the first part's path."""
    reader = gguf.GGUFReader(src)
    folder.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(
        str(folder / src.name), reader.fields["general.architecture"].contents(), split_max_tensors=max_tensors
    )
    _copy(reader, writer, (), {}, ())
    parts = sorted(folder.glob(f"{src.stem}-*-of-*.gguf"))
    assert len(parts) > 1, "max_tensors too large to split"
    return parts[0]


def _copy(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, drop, replace: dict, drop_tensors) -> None:
    """Every metadata key and tensor of `reader` through `writer` (which decides the file or the split parts), less
    the keys `drop` and tensors `drop_tensors`, with `replace`'s keys overridden; quantized tensors as raw blocks."""
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop or key in replace:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for key, (value, vtype, *sub) in replace.items():
        writer.add_key_value(key, value, vtype, sub_type=sub[0] if sub else None)
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        data = np.asarray(t.data)
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(t.name, data)
        else:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
