"""What a node knows about itself and its peers."""
from __future__ import annotations

from dataclasses import dataclass, field

from shards.shard import Shard


@dataclass(frozen=True)
class Capabilities:
    memory_bytes: int  # memory available for weights, as the node reports it (snapshot at start-up)
    engine: str  # numpy | tinygrad | mlx
    model_id: str  # the model this node serves
    n_layers: int  # layers of that model


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    address: str  # host:port of its gRPC server
    capabilities: Capabilities
    pinned: tuple[int, int] | None = None  # --shard START:END, half-open
    loaded: tuple[Shard, ...] = ()  # shards whose weights are in memory now
    active_requests: int = 0  # per-request state held (request records + KV caches)
    status: dict[str, int] = field(default_factory=dict, compare=False)  # counters for observability
    draining: bool = False  # shutting down: finishing what it has, taking nothing new


@dataclass(frozen=True)
class PeerLink:
    from_id: str
    to_id: str


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NodeInfo, ...]
    links: tuple[PeerLink, ...] = ()
