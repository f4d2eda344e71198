"""Weights a checkpoint stores fused, read as the separate projections the shared block names.

Phi-3 stores q/k/v as one `self_attn.qkv_proj.weight` and gate/up as one `mlp.gate_up_proj.weight`. Its
`layer_tensor_shapes` names each projection as a row range of the fused tensor, `NAME[start:stop/rows]`, and the
Hugging Face reader (formats.hf via formats.moe_layout.expand) reads the fused tensor once and slices it: every
engine then sees the usual q/k/v and gate/up (and fuses them again its own way).
"""

from __future__ import annotations

import re

import numpy as np

_SLICE = re.compile(r"^(?P<base>.+)\[(?P<start>\d+):(?P<stop>\d+)/(?P<rows>\d+)\]$")


def row_slice(name: str, start: int, stop: int, rows: int) -> str:
    """The name of rows start:stop of the stored tensor `name`, which has `rows` rows."""
    return f"{name}[{start}:{stop}/{rows}]"


def parse_row_slice(name: str, shape: tuple[int, ...]) -> tuple[str, int, int, int] | None:
    """(stored name, start, stop, its rows) of a `row_slice` name that gives `shape`; None for any other name."""
    m = _SLICE.match(name)
    if m is None:
        return None
    base, start, stop, rows = m["base"], int(m["start"]), int(m["stop"]), int(m["rows"])
    if stop - start != shape[0] or not 0 <= start < stop <= rows:
        raise ValueError(f"{name}: rows {start}:{stop} of {rows} do not give shape {shape}")
    return base, start, stop, rows


def row_slice_source(name: str, shape: tuple[int, ...]):
    """For a `row_slice` name: ({stored name: its shape}, how to cut the wanted rows from it); else None."""
    cut = parse_row_slice(name, shape)
    if cut is None:
        return None
    base, start, stop, rows = cut
    return {base: (rows, *shape[1:])}, lambda t: np.ascontiguousarray(t[base][start:stop])
