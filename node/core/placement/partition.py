"""Decide which contiguous range of layers each node of the ring holds: pinned ranges as given, else the split of
node/core/placement/balance.py (by measured speed, within each node's memory)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from node.core.placement.balance import FS, HOP_SECONDS, MAX_SPEED, balanced_counts, fs_per_cost, memory_cap
from shards.model.shard import Shard


@dataclass(frozen=True)
class NodeCapacity:
    node_id: str
    memory_bytes: int  # what it may hold (weights + KV); <= 0: not known, not judged
    pinned: tuple[int, int] | None = None  # layers [start, end) the node insists on (--shard START:END)
    speed: float = 0.0  # Gparam a token goes through per second (node/runtime/calibration.py); 0: unmeasured

    def __post_init__(self) -> None:
        if not (math.isfinite(self.speed) and 0 <= self.speed <= MAX_SPEED):
            raise ValueError(
                f"node {self.node_id}: speed must be 0 (unmeasured) or up to {MAX_SPEED}, got {self.speed}"
            )


class PartitionError(ValueError):
    """The nodes cannot be turned into a ring that covers every layer exactly once."""


def partition(
    nodes: Sequence[NodeCapacity],
    model_id: str,
    n_layers: int,
    costs: Sequence[int] | None = None,
    footprints: Sequence[int] | None = None,
) -> list[tuple[str, Shard]]:
    """Ordered ring: (node_id, Shard) covering [0, n_layers) exactly, first shard first, a pure function of the set
    of nodes (never of their order). `costs`: each layer's compute (parameters per token: node/core/placement/
    layer_costs.py), None for equal layers; `footprints`: each layer's bytes with its KV cache, which no node is
    given more of than its memory (None: memory not judged). Nodes left out by the split are not in the ring."""
    if not nodes:
        raise PartitionError("no nodes to place the model on")
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
        raise PartitionError(f"a model needs at least 1 layer, got n_layers={n_layers!r}")
    dupes = sorted(i for i, c in Counter(n.node_id for n in nodes).items() if c > 1)
    if dupes:
        raise PartitionError(f"duplicate node ids: {', '.join(dupes)}")
    pinned = [n for n in nodes if n.pinned is not None]
    if costs is not None and (len(costs) != n_layers or any(c <= 0 for c in costs)):
        raise PartitionError(f"layer costs must be {n_layers} positive sizes, got {len(costs)}")
    if footprints is not None and (len(footprints) != n_layers or any(f < 0 for f in footprints)):
        raise PartitionError(f"layer footprints must be {n_layers} sizes, got {len(footprints)}")
    if pinned:
        ranges = _pinned_ranges(pinned, n_layers)
    else:
        ranges = _balanced_ranges(nodes, n_layers, costs, footprints)
    return [(node_id, Shard(model_id, s, e, n_layers)) for node_id, s, e in ranges]


def check_memory(ring: Sequence[tuple[str, Shard]], nodes: Sequence[NodeCapacity], footprints: Sequence[int]) -> None:
    """Raise PartitionError naming every node whose planned layers (their weights and KV cache, `footprints` from
    node/core/placement/layer_costs.py) exceed the memory it reports, with what it would need: a plan is never made
    that a node cannot hold. Nodes reporting no memory (0) are not judged."""
    memory = {n.node_id: n.memory_bytes for n in nodes}
    over = []
    for node_id, shard in ring:
        need = sum(footprints[shard.start_layer : shard.end_layer])
        if memory.get(node_id, 0) > 0 and need > memory[node_id]:
            over.append(
                f"node {node_id} would hold layers {shard.start_layer}-{shard.end_layer - 1}: "
                f"{need / 2**30:.2f} GiB of weights and KV cache, over its {memory[node_id] / 2**30:.2f} GiB"
            )
    if over:
        raise PartitionError(
            "; ".join(over) + " (add nodes, give the node more memory with --memory-gb, or pin it fewer layers)"
        )


def _balanced_ranges(
    nodes: Sequence[NodeCapacity], n_layers: int, costs: Sequence[int] | None, footprints: Sequence[int] | None
) -> list[tuple[str, int, int]]:
    order = sorted(nodes, key=lambda n: n.node_id)  # the ring's order: the members', not their start order
    times = fs_per_cost([n.speed for n in order], costs is not None)
    caps = tuple(memory_cap(n.memory_bytes) for n in order)
    hop = round(HOP_SECONDS * FS) if costs is not None else 0
    feet = tuple(footprints) if footprints is not None else None
    counts = balanced_counts(tuple(times), caps, tuple(costs or [1] * n_layers), feet, hop)
    if counts is None:
        need = sum(footprints or ())
        have = sum(c or 0 for c in caps)
        raise PartitionError(
            f"no split of the {n_layers} layers fits the nodes' memory: they need {need / 2**30:.2f} GiB of weights "
            f"and KV cache, the {len(order)} nodes report {have / 2**30:.2f} GiB (add nodes, or give them more "
            "memory with --memory-gb)"
        )
    out, start = [], 0
    for node, count in zip(order, counts):
        if count:
            out.append((node.node_id, start, start + count))
            start += count
    return out


def _pinned_ranges(pinned: Sequence[NodeCapacity], n_layers: int) -> list[tuple[str, int, int]]:
    problems: list[str] = []
    valid: list[tuple[str, int, int]] = []
    for n in pinned:
        start, end = n.pinned  # type: ignore[misc]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)) and 0 <= start < end <= n_layers:
            valid.append((n.node_id, start, end))
        else:
            problems.append(f"node {n.node_id} pins layers {start}:{end}, outside 0 <= start < end <= {n_layers}")
    claims: list[list[str]] = [[] for _ in range(n_layers)]
    valid.sort(key=lambda r: (r[1], r[0]))  # message names nodes in layer order, whatever the input order
    for node_id, start, end in valid:
        for layer in range(start, end):
            claims[layer].append(node_id)
    # Group consecutive layers with the same problem so a big gap reads as one range, not N lines.
    gaps = [layer for layer in range(n_layers) if not claims[layer]]
    for lo, hi in _runs(gaps, [()] * len(gaps)):
        what = f"layer {lo}" if lo == hi else f"layers {lo}-{hi}"
        verb = "is" if lo == hi else "are"
        problems.append(f"{what} {verb} not covered by any pinned node")
    doubled = [layer for layer in range(n_layers) if len(claims[layer]) > 1]
    for lo, hi in _runs(doubled, [tuple(claims[layer]) for layer in doubled]):
        what = f"layer {lo}" if lo == hi else f"layers {lo}-{hi}"
        verb = "is" if lo == hi else "are"
        problems.append(f"{what} {verb} claimed by {_join(claims[lo])}")
    if problems:
        raise PartitionError("pinned shards do not tile the model: " + "; ".join(problems))
    return valid


def _runs(layers: list[int], keys: list[tuple]) -> list[tuple[int, int]]:
    """Split sorted `layers` into (first, last) runs of consecutive layers sharing the same key."""
    runs: list[tuple[int, int]] = []
    for i, layer in enumerate(layers):
        if i and layer == layers[i - 1] + 1 and keys[i] == keys[i - 1]:
            runs[-1] = (runs[-1][0], layer)
        else:
            runs.append((layer, layer))
    return runs


def _join(names: list[str]) -> str:
    if len(names) == 2:
        return f"both {names[0]} and {names[1]}"
    return "all of " + ", ".join(names[:-1]) + " and " + names[-1]
