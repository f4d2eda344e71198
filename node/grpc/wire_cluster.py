"""Conversions of the messages nodes exchange about themselves, outside any request: what a node is and holds
(`NodeInfo`, in health checks) and the weights it shares with peers (manifests and pieces, node/fetch/).

Decoded values are hostile until validated, as in node/grpc/wire.py, on the limits, `WireError` and helpers of
node/grpc/wire_base.py.
"""

from __future__ import annotations

import math

from discovery.address import parse_address
from node.core.placement.balance import MAX_SPEED
from node.core.placement.layer_costs import MAX_HEAD_WEIGHT
from node.core.topology import Availability, Capabilities, NodeInfo
from node.fetch.manifest import MAX_FILES, MAX_PIECES, Manifest, ManifestError, ModelFile, Piece
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.wire import decode_shard, encode_shard
from node.grpc.wire_base import MAX_ERROR, MAX_MODEL_ID, MAX_NAME, WireError, _count, _text

# Caps in the manner of node/grpc/wire.py's: far above any real node, low enough to bound a hostile one's message.
MAX_LOADED = 64
MAX_STATUS = 256
MAX_LAYER_RUNS = 1024

# --- topology --------------------------------------------------------------------------------------------


def encode_node_info(n: NodeInfo) -> pb.NodeInfo:
    c = n.capabilities
    m = pb.NodeInfo(
        node_id=n.node_id,
        address=n.address,
        capabilities=pb.Capabilities(
            memory_bytes=c.memory_bytes,
            engine=c.engine,
            model_id=c.model_id,
            n_layers=c.n_layers,
            speed=c.speed,
            device=c.device,
            host_memory_bytes=c.host_memory_bytes,
            head_weight=c.head_weight,
        ),
        loaded=[encode_shard(s) for s in n.loaded],
        active_requests=n.active_requests,
        status=n.status,
        draining=n.draining,
        link_port=n.link_port,
    )
    if not n.availability.complete:  # absent means complete: what nodes that never fetch have always sent
        a = n.availability
        m.availability.CopyFrom(
            pb.Availability(
                layers=[pb.LayerRun(start=s, end=e) for s, e in a.layers], embed=a.embed, head=a.head, note=a.note
            )
        )
    if n.pinned is not None:  # the proto's ShardRange repeats the model of the capabilities
        start, end = n.pinned
        m.pinned.CopyFrom(pb.ShardRange(model_id=c.model_id, start_layer=start, end_layer=end, n_layers=c.n_layers))
    return m


def decode_node_info(m: pb.NodeInfo) -> NodeInfo:
    """The node a health check describes; a WireError names the node (its id, once: the checks below don't)."""
    node_id = _text(m.node_id, "node_id")
    try:
        return _node_info(m, node_id)
    except WireError as e:
        raise WireError(f"node {node_id!r}: {e}") from e


def _node_info(m: pb.NodeInfo, node_id: str) -> NodeInfo:
    address = _text(m.address, "node address")
    try:
        parse_address(address)
    except ValueError as e:
        raise WireError(str(e)) from e
    if not m.HasField("capabilities"):
        raise WireError("no capabilities sent")
    c = m.capabilities
    if c.n_layers < 0:
        raise WireError(f"reports {c.n_layers} layers")
    model_id = _text(c.model_id, "model_id", MAX_MODEL_ID, required=False)
    if not (math.isfinite(c.speed) and 0 <= c.speed <= MAX_SPEED):  # placement divides by it
        raise WireError(f"reports a speed of {c.speed}: need 0 (unmeasured) to {MAX_SPEED:g}")
    if not (math.isfinite(c.head_weight) and 0 <= c.head_weight <= MAX_HEAD_WEIGHT):  # placement weighs the head
        raise WireError(f"reports a head weight of {c.head_weight}: need 0 (unmeasured) to {MAX_HEAD_WEIGHT:g}")
    device = _text(c.device, "device", MAX_NAME, required=False)
    caps = Capabilities(
        c.memory_bytes,
        _text(c.engine, "engine"),
        model_id,
        c.n_layers,
        c.speed,
        device,
        c.host_memory_bytes,
        c.head_weight,
    )
    pinned = None
    if m.HasField("pinned"):
        p = decode_shard(m.pinned)  # validates the range
        if (p.model_id, p.n_layers) != (caps.model_id, caps.n_layers):
            raise WireError("pins layers of another model than the one it serves")
        pinned = (p.start_layer, p.end_layer)
    loaded = tuple(decode_shard(s) for s in _count(m.loaded, "loaded shards", MAX_LOADED))
    if m.active_requests < 0:
        raise WireError(f"reports {m.active_requests} active requests")
    status = {_text(k, "status key"): int(v) for k, v in _count(m.status, "status counters", MAX_STATUS).items()}
    availability = decode_availability(m.availability, caps.n_layers) if m.HasField("availability") else Availability()
    if m.link_port > 65535:
        raise WireError(f"names data link port {m.link_port}, not a TCP port")
    return NodeInfo(
        node_id, address, caps, pinned, loaded, m.active_requests, status, m.draining, availability, m.link_port
    )


def decode_availability(m: pb.Availability, n_layers: int) -> Availability:
    runs, end = [], 0
    for r in _count(m.layers, "layer runs", MAX_LAYER_RUNS):
        if not end <= r.start < r.end <= n_layers or (runs and r.start == end):
            raise WireError(f"layer runs must be sorted, disjoint, unmerged and within {n_layers} layers")
        runs.append((r.start, r.end))
        end = r.end
    return Availability(m.complete, tuple(runs), m.embed, m.head, _text(m.note, "availability note", MAX_ERROR, False))


# --- weights (node/fetch/) -------------------------------------------------------------------------------


def encode_manifest(m: Manifest) -> pb.Manifest:
    return pb.Manifest(
        model_id=m.model_id,
        format=m.format,
        n_layers=m.n_layers,
        files=[pb.ModelFile(name=f.name, size=f.size) for f in m.files],
        pieces=[pb.Piece(file=p.file, offset=p.offset, length=p.length, part=p.part, layer=p.layer) for p in m.pieces],
        sha256=m.sha256,
        signer=m.signer,
        signature=m.signature,
    )


def decode_manifest(m: pb.Manifest) -> Manifest:
    try:  # Manifest validates everything (names, bounds, order, overlaps) and bounds the counts first
        files = tuple(ModelFile(f.name, f.size) for f in _count(m.files, "model files", MAX_FILES))
        pieces = tuple(
            Piece(p.file, p.offset, p.length, p.part, p.layer) for p in _count(m.pieces, "pieces", MAX_PIECES)
        )
        digests = tuple(_count(m.sha256, "piece digests", MAX_PIECES))
        return Manifest(m.model_id, m.format, m.n_layers, files, pieces, digests, m.signer, m.signature)
    except ManifestError as e:
        raise WireError(str(e)) from None


def decode_piece_header(m: pb.PieceChunk, length: int) -> bytes:
    """The sha256 the first message of a piece states, after checking it announces the length asked for."""
    if len(m.sha256) != 32 or m.data:
        raise WireError("a piece must start with its 32-byte sha256 and no data")
    if m.length != length:
        raise WireError(f"the piece has {length} bytes, the peer announced {m.length}")
    return m.sha256
