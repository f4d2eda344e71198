"""A request's plan as the entry node makes it: the layers split over the nodes serving the model (by each layer's
bytes where layers differ), never giving a node more than the memory it reports (node/core/placement/ring.py)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

from node.core.placement.layer_costs import file_bytes_per_param, layer_footprints
from node.core.placement.partition import PartitionError
from node.core.placement.ring import plan_ring
from node.core.plan import PlanError, PlanStep
from node.core.topology import Availability, NodeInfo
from shards.formats.config import ModelConfig


class LayerFootprints:
    """Each layer's bytes: weights at the files' bytes per parameter, plus the KV cache of one request of the
    model's whole context. None until this node holds all the files (their sizes are what is read); worked out
    once, since the files never change under a running node."""

    def __init__(
        self,
        model_path: Path,
        config: ModelConfig,
        kv_value_bytes: int,
        availability: Callable[[], Availability],
    ):
        self.model_path, self.config, self.kv_value_bytes = model_path, config, kv_value_bytes
        self.availability = availability
        self._footprints: tuple[int, ...] | None = None

    def __call__(self) -> tuple[int, ...] | None:
        if self._footprints is None and self.availability().complete:
            bpp = file_bytes_per_param(self.model_path, self.config)
            if bpp is not None:
                self._footprints = layer_footprints(
                    self.config,
                    bytes_per_param=bpp,
                    kv_tokens=self.config.max_position_embeddings,
                    kv_value_bytes=self.kv_value_bytes,
                )
        return self._footprints


def make_plan(
    members: list[NodeInfo],
    excluded: Collection[str],
    model_id: str,
    *,
    n_layers: int,
    costs: tuple[int, ...] | None,
    footprints: tuple[int, ...] | None,
) -> tuple[PlanStep, ...]:
    """Partition the layers over `members` (the nodes a ring may hold) less `excluded`: by `costs` where layers
    differ, within each node's memory when `footprints` are known. PlanError when no plan fits."""
    nodes = {n.node_id: n for n in members if n.node_id not in excluded}
    try:
        ring = plan_ring(list(nodes.values()), model_id, n_layers, costs, footprints)
    except PartitionError as e:
        raise PlanError(str(e)) from None
    return tuple(PlanStep(node_id, nodes[node_id].address, shard) for node_id, shard in ring)
