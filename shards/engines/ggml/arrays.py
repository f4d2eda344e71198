"""The ggml backend's arrays: a graph node with its numpy-order shape (`GArray`), the transposed value span the
"gemm" attention reads (`ValueLines`), and the stride arithmetic views need. ggml orders dimensions innermost first
(`ne`); these keep numpy's order and reverse at the boundary."""

from __future__ import annotations

from typing import Protocol

from shards.engines.ggml.lib import GgmlError, Tensor, g


class Ops(Protocol):
    """What an array asks of the backend building its graph (GgmlBackend, shards/engines/ggml/backend.py)."""

    def binary(self, fn, a: GArray, b: GArray) -> GArray: ...
    def slice(self, x: GArray, key) -> GArray: ...
    def reshape(self, x: GArray, shape: tuple[int, ...]) -> GArray: ...


class GArray:
    """A node of the graph being built, with numpy-style `+`, `*`, `.shape`, `.reshape` and basic slicing (views)."""

    __slots__ = ("ops", "t", "shape")

    def __init__(self, ops: Ops, t: Tensor, shape: tuple[int, ...]):
        self.ops, self.t, self.shape = ops, t, shape

    @property
    def strides(self) -> tuple[int, ...]:
        nb = self.t.contents.nb
        return tuple(int(nb[i]) for i in reversed(range(len(self.shape))))

    def __add__(self, other: GArray) -> GArray:
        return self.ops.binary(g.ggml_add, self, other)

    def __mul__(self, other: GArray) -> GArray:
        return self.ops.binary(g.ggml_mul, self, other)

    def __getitem__(self, key) -> GArray:
        return self.ops.slice(self, key)

    def reshape(self, *shape) -> GArray:
        return self.ops.reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)


class ValueLines(GArray):
    """A span of cached values stored transposed, [kv_heads, head_dim, cells]: each element's cells in one line
    (a pool made for "gemm" attention, shards/engines/ggml/cells.py). Plain GArray values are [kv_heads, cells,
    head_dim]; the type, not the shape, says which (the two shapes coincide where head_dim equals the span)."""

    __slots__ = ()


def expect(condition: bool, what: str) -> None:
    """ggml aborts the process on a shape it does not accept; a graph we build wrong must raise instead."""
    if not condition:
        raise GgmlError(f"ggml graph: unexpected shapes ({what})")


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def nocopy_strides(old: tuple[int, ...], strides: tuple[int, ...], new: tuple[int, ...]) -> tuple[int, ...] | None:
    """Strides that view `old` (with `strides`) as `new` without copying, or None (numpy's rule: dims are regrouped
    only where each group of old dims is itself contiguous)."""
    out: list[int] = [0] * len(new)
    i = j = 0
    while i < len(old) and j < len(new):
        ni, nj, i2, j2 = old[i], new[j], i + 1, j + 1
        while ni != nj:
            if ni < nj:
                ni *= old[i2]
                i2 += 1
            else:
                nj *= new[j2]
                j2 += 1
        for k in range(i, i2 - 1):  # the old dims of this group must be laid out contiguously
            if old[k + 1] != 1 and strides[k] != strides[k + 1] * old[k + 1]:
                return None
        out[j2 - 1] = strides[i2 - 1]
        for k in range(j2 - 1, j, -1):
            out[k - 1] = out[k] * new[k]
        i, j = i2, j2
    for k in range(j, len(new)):  # trailing 1s
        out[k] = out[k - 1] if k else strides[-1]
    return tuple(out)
