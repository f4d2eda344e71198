"""Weight placement of the ggml backend: where each weight of the shard lives, in which layout, for the backend's life.

Every weight tensor is a node of one weights context (`wctx`), with its bytes copied into the `WeightArena`: matmul
weights into CPU_REPACK buffers where ggml's probe accepts their type and shape and its kernels keep a row's numbers
whatever else its step holds (shards/engines/ggml/repack_probe.py; and `repack` is on), or, for a projection, where
its gemm alone does (the weight's `row_multiple`: every matmul on it takes its rows padded to that), everything else
(tables that get_rows reads, vectors, stacked experts) into plain huge-page chunks. Weights keep their GGUF block
types; nothing is dequantized but the F32 vectors. Graphs built later only point at these tensors, so placement
decides memory and kernels, never what a graph computes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from shards.engines.ggml.host_memory import WeightArena, release_file_pages
from shards.engines.ggml.lib import (
    F32,
    WEIGHT_TYPES,
    Context,
    Tensor,
    g,
    repack_supported,
    type_name,
    validate_rows,
)
from shards.engines.ggml.repack_probe import PAD_ROWS, repack_keeps_rows, repack_pads_rows
from shards.formats.quant import QuantizedTensor

# A weight that isn't repacked is checked and copied in slices of this many bytes, each slice's file pages dropped
# once copied: a tensor's pages (a 7B head's are ~100 MB) are never all resident beside its copy.
SLICE_BYTES = 8 << 20


@dataclass
class GWeight:
    """A projection [out, in] as one or more ggml tensors stacked along `out` (one when the fused parts share a
    type and width)."""

    parts: list[tuple[Tensor, int]]  # (tensor, out rows)
    ggml_types: tuple[int, ...]
    nbytes: int
    repacked: bool = False  # in CPU_REPACK: for mul_mat only (get_rows would read the interleaved blocks as rows)
    row_multiple: int = 1  # a matmul on it takes its rows padded to a multiple of this (repack_probe.PAD_ROWS)

    def __post_init__(self):
        if self.row_multiple < 1 or (self.row_multiple > 1 and not self.repacked):
            raise ValueError(f"only a repacked weight pads its rows, to a multiple >= 1, not {self.row_multiple}")

    @property
    def tensor(self) -> Tensor:
        return self.parts[0][0]


def _slices(a: np.ndarray) -> list[np.ndarray]:
    """`a` as views of whole rows (its first axis) of at most SLICE_BYTES each, or whole where it is smaller."""
    if a.ndim < 2 or a.nbytes <= SLICE_BYTES:
        return [a]
    rows = max(1, SLICE_BYTES * len(a) // a.nbytes)
    return [a[i : i + rows] for i in range(0, len(a), rows)]


class GgmlWeights:
    """The conversions of GgmlBackend's `Backend` (shards/engines/ggml/backend.py): `weight`, `fused_weight`, `table`
    and `array` place the shard's weights once, as it loads; `free` releases them all. Mixed in ahead of `Backend`,
    whose generic `fused_weight` and `table` (a float concatenation, a plain array) these replace. A repacked tensor
    is only ever a matmul operand: `table` asks for plain rows, since get_rows cannot read interleaved blocks."""

    def __init__(self, capacity: int, repack: bool):
        self.wctx = Context(capacity)  # room for `capacity` weight tensors
        self.arena = WeightArena()
        self.repack = repack  # matmul weights into CPU_REPACK where the probe allows
        self.repacked: dict[str, int] = {}  # type name -> tensors repacked
        self.padded: set[int] = set()  # addresses of the repacked tensors whose matmuls pad their rows (PAD_ROWS)
        self.in_repack: set[int] = set()  # addresses of every repacked tensor
        self.plain_shapes: set[tuple[int, int]] = set()  # (type, row length) of the weights in plain memory
        self.shared: dict[int, GWeight] = {}  # id(embedding source) -> its weight, while loading (tied heads)

    def _upload(
        self, ggml_type: int, shape: tuple[int, ...], pieces: list[np.ndarray], what: str, matmul: bool = False
    ) -> Tensor:
        """One weight tensor from its row blocks `pieces` (stacked along `out`), copied in place by place, so a fused
        projection never needs a stacked copy in memory (a freed one of tens of MB tends to stay resident)."""
        if ggml_type not in WEIGHT_TYPES:
            raise ValueError(f"{what}: weight type {type_name(ggml_type)} is not supported by the ggml engine")
        pieces = [np.ascontiguousarray(p) for p in pieces]
        ne = tuple(reversed(shape))
        t = self.wctx.new(ggml_type, ne)
        layout = self._repack_layout(ggml_type, ne) if matmul and self.repack else None
        if layout is not None:
            for p in pieces:
                validate_rows(ggml_type, p, what)
            # ggml re-lays a repacked tensor out as it is set, which it only does whole: from one array, since
            # fused_weight keeps such parts apart (a copy of them into one would be a transient of their size)
            if len(pieces) != 1:
                raise ValueError(f"{what}: a repacked tensor is set from one array, not {len(pieces)}")
            self.arena.place_repacked(t, pieces[0])
            self.repacked[type_name(ggml_type)] = self.repacked.get(type_name(ggml_type), 0) + 1
            self.in_repack.add(ctypes.addressof(t.contents))
            if layout == "padded":
                self.padded.add(ctypes.addressof(t.contents))
            for p in pieces:
                release_file_pages(p)
        else:  # a slice at a time, its file pages dropped as it is copied: loading peaks at one slice, not a tensor
            slices = [s for p in pieces for s in _slices(p)]
            self.plain_shapes.add((ggml_type, ne[0]))  # (quant_rows.py probes the matmuls' kinds at load)
            self.arena.place(t, slices, lambda s: validate_rows(ggml_type, s, what), release_file_pages)
        return t

    @staticmethod
    def _repack_layout(ggml_type: int, ne: tuple[int, ...]) -> str | None:
        """ "rows": CPU_REPACK keeps a row's numbers at any row count; "padded": only its gemm does, so a projection
        (never stacked experts: a step routes any count of rows to each) takes its rows in multiples of PAD_ROWS;
        None: plain memory."""
        if not repack_supported(ggml_type, ne):
            return None
        if repack_keeps_rows(ggml_type):
            return "rows"
        return "padded" if len(ne) == 2 and repack_pads_rows(ggml_type) else None

    def _matrix(self, w: np.ndarray | QuantizedTensor) -> tuple[int, tuple[int, ...], np.ndarray, str]:
        if isinstance(w, QuantizedTensor):
            return int(w.ggml_type), w.shape, w.data, w.name
        if w.ndim != 2:
            raise ValueError(f"expected a 2-D weight, got shape {w.shape}")
        return F32, w.shape, np.asarray(w, dtype=np.float32), "weight"

    def fused_weight(self, *parts, matmul: bool = True) -> GWeight:
        specs = [self._matrix(p) for p in parts]
        stacked = (specs[0][1][1], sum(s[1][0] for s in specs))  # ne of one tensor of them all
        # one type and width: one tensor of the stacked rows (exact), but one CPU_REPACK takes is set whole, so its
        # parts would be copied into one array first (a 7B's gate and up: 63 MB beside their file pages): kept apart
        if len({(s[0], s[1][1]) for s in specs}) == 1 and (
            len(specs) == 1 or not (matmul and self.repack and self._repack_layout(specs[0][0], stacked))
        ):
            ggml_type, _, _, name = specs[0]
            groups = [(ggml_type, (sum(s[1][0] for s in specs), specs[0][1][1]), [s[2] for s in specs], name)]
        else:  # kept apart; linear concatenates their outputs
            groups = [(t, shape, [data], name) for t, shape, data, name in specs]
        before = sum(self.repacked.values())
        tensors = [(self._upload(t, shape, pieces, name, matmul), shape[0]) for t, shape, pieces, name in groups]
        padded = any(ctypes.addressof(t.contents) in self.padded for t, _ in tensors)
        return GWeight(
            tensors,
            tuple(group[0] for group in groups),
            sum(int(g.ggml_nbytes(t)) for t, _ in tensors),
            sum(self.repacked.values()) > before,
            PAD_ROWS if padded else 1,
        )

    def weight(self, w) -> GWeight:
        # A tied head is the embedding table itself: ShardModel builds the table first, and both sources are alive
        # while it loads, so an equal id() means the same array.
        return self.shared.get(id(w)) or self.fused_weight(w)

    def table(self, t) -> GWeight:
        """The embedding stays quantized: get_rows dequantizes only the rows it looks up."""
        self.shared[id(t)] = weight = self.fused_weight(t, matmul=False)  # get_rows cannot read repacked rows
        return weight

    def loaded(self) -> None:
        """The model is built: forget the ids used to share the tied embedding (they may be reused from now on), and
        seal the arena's last chunk."""
        self.shared.clear()
        self.arena.seal()

    def array(self, a: np.ndarray | QuantizedTensor) -> GWeight:
        """Norm weights and biases, as F32 (they are F32 in GGUF files, and tiny)."""
        v = a.dequantize() if isinstance(a, QuantizedTensor) else np.asarray(a, dtype=np.float32)
        return GWeight([(self._upload(F32, v.shape, [v], "vector"), v.shape[0])], (F32,), v.nbytes)

    def free(self) -> None:
        self.arena.free()
        self.wctx.free()
