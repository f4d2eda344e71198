"""One GGUF file, opened once per process: its metadata and a validated table of its tensors.

The `gguf` package (llama.cpp's own reader) parses the header. A model file is untrusted input, so everything the
reader hands back is checked before use: metadata values get typed accessors whose errors name the file and the
key, and the tensor table is validated here (known type, whole blocks, byte range inside the file, no overlaps)
instead of letting a truncated file surface later as a reshape error in the middle of a request.
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from shards.formats.gguf_names import SPLIT_NAME, GGUFError

_MISSING = object()


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie. `shape` is in GGUF order (innermost first), as the file states it."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int
    part: int = 0  # which file of a split model holds it (0 for a single file)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """Row-major shape, outermost first: a 2-D weight is [out_features, in_features] as in Hugging Face."""
        return tuple(reversed(self.shape))


class _Reader(GGUFReader):
    """GGUFReader, minus three costs we don't want.

    - It slices its np.memmap once per metadata string (~100k times for a 49k-token vocabulary), and memmap slices
      are slow to create; a plain ndarray view of the same mapping parses the same header several times faster.
    - It builds every tensor's array during parsing, so a truncated file fails there with an opaque reshape error;
      we keep the raw tensor table instead and validate it ourselves (GGUFFile._tensor_table).
    - It makes a numpy array of every item of an array (128k for a 32k vocabulary's tokens, scores and types): most
      of the parse's time, and garbage that leaves the heap fragmented for good. Long arrays come in three parts
      instead (`_get_field_parts`).
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)  # same memory map, no copy

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        # Past the end of the file the base reader returns an empty slice instead of failing: an array that claims
        # 2^40 elements then "reads" nothing forever and fills memory (a 45-byte file hung the node).
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if int(count) < 0 or end > self._plain.size:
            raise ValueError(
                f"the header says {count} values of {np.dtype(dtype)} at byte {offset}, past the end "
                f"of the file ({self._plain.size} bytes)"
            )
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list]:
        """A long array of numbers or strings (little-endian file) as its item type, its count and its items: the
        numbers as one array; the strings as the bytes they fill, then each one's start and length in them (two
        arrays after it: `_Packed.of` reads them). Anything else as the base reader parses it."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        n, item, at = int(alen[0]), int(itype[0]), orig_offs + 12
        number = self.gguf_scalar_to_np.get(item)
        if n < _Packed.LONG or (number is None and item != GGUFValueType.STRING):
            return super()._get_field_parts(orig_offs, raw_type)
        types = [GGUFValueType.ARRAY, GGUFValueType(item)]
        if number is not None:
            values = self._get(at, number, n)
            return 12 + values.nbytes, [itype, alen, values], [2], types
        starts, lengths, raw, size = [], [], memoryview(self._plain), self._plain.size
        for _ in range(n):
            if at + 8 > size:
                raise ValueError(f"a string's length at byte {at} lies past the end of the file ({size} bytes)")
            (length,) = struct.unpack_from("<Q", raw, at)
            starts.append(at + 8)
            lengths.append(length)
            at += 8 + length
        if at > size:
            raise ValueError(f"a string ends at byte {at}, past the end of the file ({size} bytes)")
        base = orig_offs + 12
        strings = [self._plain[base:at], np.array(starts, np.int64) - base, np.array(lengths, np.int64)]
        return at - orig_offs, [itype, alen, *strings], [2], types

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        self.tensor_start = start_offs
        self.tensor_fields = fields
        self.tensors = []


class GGUFFile:
    """Metadata + tensor table of one GGUF file. Use `open_gguf(path)`, which caches by path, size and mtime."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.size = path.stat().st_size
            reader = _Reader(path, "r")
        except FileNotFoundError:
            raise GGUFError(f"{path}: no such file") from None
        except Exception as e:  # the reader raises anything from ValueError to IndexError on damaged headers
            raise GGUFError(f"{path}: not a readable GGUF file ({self._why(e)})") from None
        self.data: np.ndarray = reader.data  # the whole file, memory-mapped read-only
        # Keep plain values, not the reader: its per-element numpy parts of a 49k-token vocabulary hold ~60 MB, for
        # the life of the node; long arrays packed (`_Packed`). A value that cannot be decoded is kept as its error,
        # raised if someone asks for it.
        self.meta: dict[str, tuple[tuple[GGUFValueType, ...], Any]] = {}
        for key, field in reader.fields.items():
            try:
                value = _Packed.of(field) or field.contents()
            except Exception as e:  # e.g. a string that is not UTF-8
                value = _Unreadable(f"{type(e).__name__}: {e}")
            self.meta[key] = (tuple(field.types), value)
        self.split_count, self.split_no = self.get_int("split.count", 1), self.get_int("split.no", 0)
        if not 0 <= self.split_no < max(self.split_count, 1):
            raise GGUFError(f"{path}: split.no {self.split_no} is not a part of split.count {self.split_count}")
        self.tensors = self._tensor_table(reader)

    def parts(self) -> list[GGUFFile]:
        """The files the model's tensors lie in: this one (a split model: every part, in order)."""
        return [self]

    def _why(self, e: Exception) -> str:
        text = str(e)
        if "magic" in text.lower():
            return "wrong magic: the file does not start with 'GGUF'"
        if isinstance(e, (IndexError, OverflowError)) or "cannot reshape" in text or "empty file" in text:
            return f"truncated or corrupt header ({type(e).__name__}: {text})"
        return f"{type(e).__name__}: {text}"

    def _tensor_table(self, reader: _Reader) -> dict[str, TensorInfo]:
        table: dict[str, TensorInfo] = {}
        for field in reader.tensor_fields:
            _, name_data, _, dims, raw_type, rel_offset = field.parts
            try:
                name = bytes(name_data).decode("utf-8")
            except UnicodeDecodeError:
                raise GGUFError(f"{self.path}: a tensor name is not valid UTF-8") from None
            if name in table:
                raise GGUFError(f"{self.path}: tensor {name!r} appears twice")
            try:
                ggml_type = GGMLQuantizationType(int(raw_type[0]))
            except ValueError:
                raise GGUFError(f"{self.path}: tensor {name!r} has unknown ggml type {int(raw_type[0])}") from None
            shape = tuple(int(d) for d in dims)
            if ggml_type not in GGML_QUANT_SIZES:
                raise GGUFError(f"{self.path}: tensor {name!r} has ggml type {ggml_type.name} of unknown size")
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            if not shape or any(d <= 0 for d in shape) or shape[0] % block:
                raise GGUFError(
                    f"{self.path}: tensor {name!r} has shape {list(shape)}, which is not whole "
                    f"{ggml_type.name} blocks of {block} along its first dimension"
                )
            nbytes = int(np.prod(shape, dtype=object)) // block * type_size
            offset = reader.tensor_start + int(rel_offset[0])
            if offset + nbytes > self.size:
                raise GGUFError(
                    f"{self.path}: truncated: tensor {name!r} ({ggml_type.name} {list(shape)}) needs bytes "
                    f"{offset}..{offset + nbytes} but the file ends at {self.size}"
                )
            table[name] = TensorInfo(name, ggml_type, shape, offset, nbytes)
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in table.values())
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise GGUFError(
                    f"{self.path}: tensors {a!r} and {b!r} overlap: the byte count of {a!r} does not "
                    "match its type and shape, or the tensor table is corrupt"
                )
        return table

    # -- tensors ----------------------------------------------------------------------------------------------
    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the memory map, [rows, bytes per row]."""
        flat = self.data[info.offset : info.offset + info.nbytes]
        rows = int(np.prod(info.shape[1:], dtype=np.int64))
        view = flat.reshape(rows, info.nbytes // rows)
        view.flags.writeable = False
        return view

    def tensor(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: tensor {name!r} not found")
        return info

    # -- metadata ---------------------------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.meta

    def get(self, key: str, kinds: set[GGUFValueType], what: str, default: Any = _MISSING) -> Any:
        """The value of `key`, which must be of one of `kinds` (an array: of items of `kinds`), else `default`."""
        if key not in self.meta:
            if default is _MISSING:
                raise GGUFError(f"{self.path}: missing metadata key {key!r}")
            return default
        types, value = self.meta[key]
        is_array = types[0] == GGUFValueType.ARRAY
        item = types[-1] if is_array and len(types) > 1 else None
        if (
            is_array != (GGUFValueType.ARRAY in kinds)
            or (item is not None and item not in kinds)
            or (not is_array and types[0] not in kinds)
        ):
            raise GGUFError(f"{self.path}: metadata {key!r} must be {what}, got {'/'.join(t.name for t in types)}")
        if isinstance(value, _Packed):
            try:
                return value.unpack()
            except UnicodeDecodeError as e:
                value = _Unreadable(f"{type(e).__name__}: {e}")
        if isinstance(value, _Unreadable):
            raise GGUFError(f"{self.path}: metadata {key!r} is unreadable ({value.why})")
        return value

    def get_int(self, key: str, default: Any = _MISSING) -> int:
        value = self.get(key, INTS, "an integer", default)
        return value if value is default else int(value)

    def get_float(self, key: str, default: Any = _MISSING) -> float:
        value = self.get(key, INTS | FLOATS, "a number", default)
        return value if value is default else float(value)

    def get_bool(self, key: str, default: Any = _MISSING) -> bool:
        return self.get(key, {GGUFValueType.BOOL}, "true or false", default)

    def get_str(self, key: str, default: Any = _MISSING) -> str:
        return self.get(key, STRINGS, "a string", default)

    def get_list(self, key: str, items: set[GGUFValueType], what: str, default: Any = _MISSING) -> list:
        return self.get(key, items | {GGUFValueType.ARRAY}, f"an array of {what}", default)


@dataclass(frozen=True)
class _Unreadable:
    why: str


@dataclass(frozen=True, eq=False)
class _Packed:
    """A long array's items in one numpy buffer; strings as their UTF-8 bytes end to end, with where each ends.

    As Python objects a vocabulary's tokens and scores are megabytes every node holds for good, though only the
    tokenizer's build reads them; packed, a tenth of that. Unpacked at each read into the list the reader's
    `contents()` gives."""

    LONG = 256  # arrays of this many items and more are packed

    items: np.ndarray  # the numbers, or the strings' bytes
    ends: np.ndarray | None = None  # strings: where each ends in `items`

    @classmethod
    def of(cls, field) -> _Packed | None:
        """`field` packed if `_Reader` parsed it as a long array (its items in one part), else None."""
        types = field.types
        if len(types) != 2 or types[0] != GGUFValueType.ARRAY or types[1] == GGUFValueType.ARRAY:
            return None
        count = int(field.parts[4][0])  # after the key's length, the key and the value's type: the item type, count
        if len(field.data) != 1 or count < cls.LONG:  # a short array, or item by item (a big-endian file)
            return None
        at = field.data[0]
        if types[1] != GGUFValueType.STRING:
            return cls(field.parts[at].copy())
        region, starts, lengths = field.parts[at : at + 3]
        prefixes = (starts[:, None] - 8 + np.arange(8)).ravel()  # each string's 8-byte length before it
        return cls(np.delete(region, prefixes).view(np.uint8), np.cumsum(lengths))

    def unpack(self) -> list:
        if self.ends is None:
            return self.items.tolist()
        raw, starts = self.items.tobytes(), [0, *self.ends[:-1].tolist()]
        return [raw[a:b].decode("utf-8") for a, b in zip(starts, self.ends.tolist())]


INTS = {
    GGUFValueType.UINT8,
    GGUFValueType.INT8,
    GGUFValueType.UINT16,
    GGUFValueType.INT16,
    GGUFValueType.UINT32,
    GGUFValueType.INT32,
    GGUFValueType.UINT64,
    GGUFValueType.INT64,
}
FLOATS = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}
STRINGS = {GGUFValueType.STRING}


class SplitGGUF(GGUFFile):
    """A model split by llama.cpp's gguf-split (or gguf-py's writer) into `NAME-00001-of-0000N.gguf` ... parts: the
    metadata of the first part, and one tensor table over all parts, each tensor knowing its part.

    Every part's header is parsed (a few KB to MB: a node fetching from a peer holds every header and only its own
    tensors' bytes), and each part is memory-mapped, so only the pages of the tensors a shard reads are ever read.
    Checked: the parts are all there, each says the same split.count and its own split.no, no tensor lies in two
    parts, and the tensors add up to the first part's split.tensors.count."""

    def __init__(self, parts: list[GGUFFile]):
        first = parts[0]
        self.path, self.meta, self.parts_ = first.path, first.meta, parts
        self.split_count, self.split_no = first.split_count, 0
        self.size = sum(p.size for p in parts)
        self.data = first.data
        self.tensors: dict[str, TensorInfo] = {}
        for i, part in enumerate(parts):
            if (part.split_count, part.split_no) != (len(parts), i):
                raise GGUFError(
                    f"{part.path}: says it is part {part.split_no + 1} of {part.split_count}, but it is "
                    f"named as part {i + 1} of {len(parts)}"
                )
            for name, info in part.tensors.items():
                if name in self.tensors:
                    raise GGUFError(f"{part.path}: tensor {name!r} is also in part {self.tensors[name].part + 1}")
                self.tensors[name] = TensorInfo(info.name, info.ggml_type, info.shape, info.offset, info.nbytes, i)
        expected = first.get_int("split.tensors.count")
        if expected != len(self.tensors):
            raise GGUFError(
                f"{first.path}: split.tensors.count says {expected} tensors, the parts hold {len(self.tensors)}"
            )

    def parts(self) -> list[GGUFFile]:
        return list(self.parts_)

    def raw(self, info: TensorInfo) -> np.ndarray:
        return self.parts_[info.part].raw(info)


def split_part_paths(path: Path, count: int) -> list[Path]:
    """The paths of a split model's parts, from one part's name (llama.cpp's `%s-%05d-of-%05d.gguf`)."""
    m = SPLIT_NAME.match(path.name)
    if not m or int(m.group("count")) != count:
        raise GGUFError(
            f"{path}: says it is one of {count} split parts, but its name is not "
            f"NAME-0000k-of-{count:05d}.gguf, so its other parts can't be found"
        )
    return [path.with_name(f"{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


@functools.lru_cache(maxsize=64)  # the parts of a split model each count
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(Path(path))


def _open_file(path: Path) -> GGUFFile:
    try:
        st = os.stat(path)
    except OSError as e:
        raise GGUFError(f"{path}: cannot open ({e.strerror})") from None
    return _open(str(path.resolve()), st.st_size, st.st_mtime_ns)


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF header once per process (config, tokenizer and engines all read the same file). A split model is
    named by its first part and opened whole (`SplitGGUF`); naming another part is refused with the first's name."""
    path = Path(path)
    f = _open_file(path)
    if f.split_count <= 1:
        return f
    paths = split_part_paths(path, f.split_count)
    if f.split_no != 0:
        raise GGUFError(f"{path}: is part {f.split_no + 1} of a split model; name its first part, {paths[0].name}")
    for p in paths:
        if not p.is_file():
            raise GGUFError(f"{path}: part {p.name} of this split model is missing")
    return SplitGGUF([f] + [_open_file(p) for p in paths[1:]])
