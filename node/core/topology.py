"""What a node knows about itself and its peers."""

from __future__ import annotations

from dataclasses import dataclass, field

from shards.model.shard import Shard


@dataclass(frozen=True)
class Capabilities:
    memory_bytes: int  # memory available for weights, as the node reports it (snapshot at start-up)
    engine: str  # numpy | tinygrad | mlx
    model_id: str  # the model this node serves
    n_layers: int  # layers of that model
    speed: float = 0.0  # billions of parameters a token goes through per second on one row: what placement balances
    # (node/runtime/calibration.py; --speed); 0: not measured yet, counted as the others' (node/core/placement/)
    device: str = ""  # the GPU its layers compute on ("CUDA0 (NVIDIA H200)"; memory_bytes is then that GPU's); "": CPU
    host_memory_bytes: int = 0  # the host's memory beside a GPU's; 0: not reported
    head_weight: float = 0.0  # what a parameter of the output head costs it in layer parameters, as it measured
    # them (node/runtime/calibration.py); 0: not measured (placement then goes by the file: layer_costs.py)


@dataclass(frozen=True)
class Availability:
    """Which layers a node can serve from its own disk. A node started with the model's files has all of them
    (`complete`); a node that fetches its layers from a peer (node/fetch/) has the runs it has verified so far."""

    complete: bool = True
    layers: tuple[tuple[int, int], ...] = ()  # half-open runs of layers held (when not complete), sorted, disjoint
    embed: bool = False  # holds the token embedding (needed by a first shard)
    head: bool = False  # holds the final norm and the output head (needed by a last shard)
    note: str = ""  # what its fetching is doing, for people reading the topology ("fetching layers 2-3: 40%")

    def can_serve(self, shard: Shard) -> bool:
        if self.complete:
            return True
        if (shard.is_first and not self.embed) or (shard.is_last and not self.head):
            return False
        return any(start <= shard.start_layer and shard.end_layer <= end for start, end in self.layers)


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
    availability: Availability = Availability()  # the layers it can serve (all of them unless it fetches)
    link_port: int = 0  # its data link's port on the address's host (node/grpc/link/); 0: none


@dataclass(frozen=True)
class PeerLink:
    from_id: str
    to_id: str


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NodeInfo, ...]
    links: tuple[PeerLink, ...] = ()
