"""Decide which contiguous range of layers each node of the ring holds."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from shards.model.shard import Shard


@dataclass(frozen=True)
class NodeCapacity:
    node_id: str
    memory_bytes: int
    pinned: tuple[int, int] | None = None  # layers [start, end) the node insists on (--shard START:END)


class PartitionError(ValueError):
    """The nodes cannot be turned into a ring that covers every layer exactly once."""


def partition(
    nodes: Sequence[NodeCapacity], model_id: str, n_layers: int, costs: Sequence[int] | None = None
) -> list[tuple[str, Shard]]:
    """Ordered ring: (node_id, Shard) covering [0, n_layers) exactly, first shard first. With `costs` (each layer's
    size, node/core/placement/layer_costs.py) the split follows the nodes' memory in bytes, else in layer counts."""
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
    ranges = _pinned_ranges(pinned, n_layers) if pinned else _weighted_ranges(nodes, n_layers, costs)
    return [(node_id, Shard(model_id, s, e, n_layers)) for node_id, s, e in ranges]


def check_memory(ring: Sequence[tuple[str, Shard]], nodes: Sequence[NodeCapacity], footprints: Sequence[int]) -> None:
    """Raise PartitionError naming every node whose planned layers (their weights and KV cache, `footprints` from
    node/core/placement/layer_costs.py) exceed the memory it reports, with what it would need: a plan is never made that a node
    cannot hold. Nodes reporting no memory (0) are not judged."""
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


def _weighted_ranges(
    nodes: Sequence[NodeCapacity], n_layers: int, costs: Sequence[int] | None = None
) -> list[tuple[str, int, int]]:
    # Biggest node first so the ring order (and who gets the extra layer) does not depend on input order.
    order = sorted(nodes, key=lambda n: (-max(n.memory_bytes, 0), n.node_id))[:n_layers]
    weights = [max(n.memory_bytes, 0) for n in order]
    if not any(weights):
        weights = [1] * len(order)
    counts = _apportion(weights, n_layers) if costs is None else _by_cost(weights, costs)
    out, start = [], 0
    for node, count in zip(order, counts):
        out.append((node.node_id, start, start + count))
        start += count
    return out


def _by_cost(weights: list[int], costs: Sequence[int]) -> list[int]:
    """Layer counts of consecutive shards whose sizes follow `weights`: each cut is where the running size comes
    closest to the running share (exact fractions; ties: the earlier cut), every shard keeping >= 1 layer."""
    cum = [0]
    for c in costs:
        cum.append(cum[-1] + c)
    total, weight, share = cum[-1], sum(weights), 0
    cuts = [0]
    for j, w in enumerate(weights[:-1]):
        share += w
        target = Fraction(total * share, weight)
        lo, hi = cuts[-1] + 1, len(costs) - (len(weights) - 1 - j)
        cuts.append(min(range(lo, hi + 1), key=lambda c: (abs(cum[c] - target), c)))
    cuts.append(len(costs))
    return [b - a for a, b in zip(cuts, cuts[1:])]


def _apportion(weights: list[int], total: int) -> list[int]:
    """Largest-remainder split of `total` by `weights`, each >= 1; ties go to the earlier index.

    Needs len(weights) <= total. Nodes whose share is below one layer are fixed at 1 and the rest
    re-split among the others, repeatedly, so the minimum costs the big nodes as little as possible.
    """
    counts = [0] * len(weights)
    pool = list(range(len(weights)))
    left = total
    while True:
        pool_weight = sum(weights[i] for i in pool)
        # Fractions keep the comparisons exact, so tie-breaking never hinges on float rounding.
        quota = {i: Fraction(left * weights[i], pool_weight) if pool_weight else Fraction(0) for i in pool}
        small = [i for i in pool if quota[i] < 1]
        if not small:
            break
        for i in small:
            counts[i] = 1
        left -= len(small)
        pool = [i for i in pool if quota[i] >= 1]
        if not pool:  # only reachable when every weight left is 0, i.e. all weights were forced
            return counts
    for i in pool:
        counts[i] = int(quota[i])  # floor; quota >= 1 here so every node keeps >= 1
    spare = left - sum(counts[i] for i in pool)
    by_remainder = sorted(pool, key=lambda i: (-(quota[i] - counts[i]), i))
    for i in by_remainder[:spare]:
        counts[i] += 1
    return counts


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
