"""Which node runs which layers, given that some nodes may not hold all their layers yet.

Every node computes the same *target* ring over all members (the split by measured speed within each node's memory,
node/core/placement/balance.py, or the pinned ranges):
that is what each node should hold, and a node fetching its weights fetches its target range. A request gets the
target ring once every node of it can serve its part; until then it gets a ring over the nodes that can: the
complete nodes (those with the whole model) partitioned among themselves, else a chain of the runs of layers that
nodes hold. A request is never planned onto a node for layers it doesn't hold.
"""

from __future__ import annotations

from collections.abc import Sequence

from node.core.placement.partition import NodeCapacity, PartitionError, check_memory, partition
from node.core.topology import NodeInfo
from shards.model.shard import Shard


def _capacities(nodes: Sequence[NodeInfo]) -> list[NodeCapacity]:
    return [NodeCapacity(n.node_id, n.capabilities.memory_bytes, n.pinned, n.capabilities.speed) for n in nodes]


def target_ring(
    nodes: Sequence[NodeInfo],
    model_id: str,
    n_layers: int,
    costs: Sequence[int] | None = None,
    footprints: Sequence[int] | None = None,
) -> list[tuple[str, Shard]]:
    """The ring the cluster is meant to have: every member it keeps holds its part (split by `costs`, each layer's
    compute, and the nodes' speeds, within their memory given `footprints`: node/core/placement/partition.py).
    Raises PartitionError."""
    return partition(_capacities(nodes), model_id, n_layers, costs, footprints)


def plan_ring(
    nodes: Sequence[NodeInfo],
    model_id: str,
    n_layers: int,
    costs: Sequence[int] | None = None,
    footprints: Sequence[int] | None = None,
) -> list[tuple[str, Shard]]:
    """The ring a request starting now gets: the target ring if every node is ready for its part, else one over
    the nodes that are. Raises PartitionError when the nodes can't cover every layer, or (given `footprints`, each
    layer's weights and KV bytes: node/core/placement/layer_costs.py) when a node's part would not fit the memory it reports."""
    ring = _plan_ring(nodes, model_id, n_layers, costs, footprints)
    if footprints is not None:
        check_memory(ring, _capacities(nodes), footprints)
    return ring


def _plan_ring(
    nodes: Sequence[NodeInfo],
    model_id: str,
    n_layers: int,
    costs: Sequence[int] | None,
    footprints: Sequence[int] | None,
) -> list[tuple[str, Shard]]:
    by_id = {n.node_id: n for n in nodes}
    ring, target_error = None, None
    try:
        ring = target_ring(nodes, model_id, n_layers, costs, footprints)
    except PartitionError as e:
        target_error = e
    if ring is not None and all(by_id[node_id].availability.can_serve(shard) for node_id, shard in ring):
        return ring
    if target_error is not None and all(n.availability.complete for n in nodes):
        raise target_error  # nobody is fetching: the target's own problem (pins with gaps) is the answer
    complete = [n for n in nodes if n.availability.complete]
    if complete:
        try:
            return target_ring(complete, model_id, n_layers, costs, footprints)
        except PartitionError:
            pass  # e.g. the complete nodes are pinned to ranges with gaps: try with the others' layers
    chain = _chain(nodes, model_id, n_layers)
    if chain is not None:
        return chain
    if target_error is not None:
        raise target_error
    missing = [layer for layer in range(n_layers) if not any(_holds(n, layer) for n in nodes)]
    what = _ranges(missing) if missing else "a chain of the layers (with the embedding and output head)"
    raise PartitionError(f"no node holds {what} yet (nodes are still fetching their layers)")


def _chain(nodes: Sequence[NodeInfo], model_id: str, n_layers: int) -> list[tuple[str, Shard]] | None:
    """Layers 0..n covered by as few hops as possible: from each layer on, the node that can serve the longest
    range starting there (ties: the node id), each node at most once. Pinned nodes only serve their pins."""
    ring, start, used = [], 0, set()
    while start < n_layers:
        best: tuple[int, str] | None = None
        for n in nodes:
            end = _reach(n, start, n_layers)
            if end > start and n.node_id not in used and (best is None or (end, best[1]) > (best[0], n.node_id)):
                best = (end, n.node_id)
        if best is None:
            return None
        ring.append((best[1], Shard(model_id, start, best[0], n_layers)))
        used.add(best[1])
        start = best[0]
    return ring


def _reach(n: NodeInfo, start: int, n_layers: int) -> int:
    """The furthest end such that `n` can serve layers start..end-1 (start itself when it can't serve any)."""
    lo, hi = n.pinned or (0, n_layers)
    a = n.availability
    if not lo <= start < hi or (start == 0 and not (a.complete or a.embed)):
        return start
    if a.complete:
        return hi
    end = next((min(e, hi) for s, e in a.layers if s <= start < e), start)
    return end - 1 if end == n_layers and not a.head else end


def _holds(n: NodeInfo, layer: int) -> bool:
    a = n.availability
    return a.complete or any(s <= layer < e for s, e in a.layers)


def _ranges(layers: list[int]) -> str:
    runs: list[list[int]] = []
    for layer in layers:
        if runs and runs[-1][1] == layer - 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ("layer " if len(layers) == 1 else "layers ") + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
