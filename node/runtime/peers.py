"""What a node knows of the other members: the one place that holds it, read by plans, the API, metrics and the
fetch follower, written only by membership's updates and by peers saying they leave.

Two views, kept apart on purpose: `known` is every member that answers (draining ones too), by id and address:
plans a peer sends us must stay within it, and we send to members at the addresses it gives. `peers` are the live
peers new plans may use (a draining peer is known but no longer a peer).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType

from node.core.logs import node_log
from node.core.topology import NodeInfo


class PeerView:
    def __init__(self, node_id: str, address: str):
        self.node_id, self.address = node_id, address
        self.counters: Counter[str] = Counter()  # peers_joined, peers_left
        self._known: dict[str, str] = {node_id: address}
        self._peers: dict[str, NodeInfo] = {}
        self.log = node_log(__name__, node_id)

    def known(self) -> Mapping[str, str]:
        """Every member that answers, this node included: id -> address (read-only)."""
        return MappingProxyType(self._known)

    def peers(self) -> tuple[NodeInfo, ...]:
        """The live peers new plans may use, by node id."""
        return tuple(sorted(self._peers.values(), key=lambda n: n.node_id))

    def serving(self, model_id: str, n_layers: int) -> tuple[NodeInfo, ...]:
        """The peers that serve this model (same id, same number of layers): the ones a ring may hold."""
        return tuple(
            n for n in self.peers() if (n.capabilities.model_id, n.capabilities.n_layers) == (model_id, n_layers)
        )

    def name_of(self, address: str) -> str:
        """The id of the peer at `address`, or the address itself when no peer is known there."""
        return next((p.node_id for p in self._peers.values() if p.address == address), address)

    def update(self, peers: Mapping[str, NodeInfo], alive: Mapping[str, str]) -> list[str]:
        """Membership's latest view: the peers new plans may use, and every peer that answered (draining ones too)
        with its address. Returns the addresses of the peers that are gone for good (left and no longer answer),
        whose connections the caller may close: a draining peer still finishes requests with us, so it is kept."""
        self._known = {self.node_id: self.address} | dict(alive)
        gone_for_good = []
        for gone in self._peers.keys() - peers.keys():
            self.log.info("peer %s left", gone)
            self.counters["peers_left"] += 1
            if gone not in alive:
                gone_for_good.append(self._peers[gone].address)
        for new in peers.keys() - self._peers.keys():
            self.log.info("peer %s joined at %s", new, peers[new].address)
            self.counters["peers_joined"] += 1
        self._peers = dict(peers)
        return gone_for_good

    def leaving(self, node_id: str, caller: str | None = None) -> None:
        """A peer said it is shutting down: plan without it from now on (its requests in flight go on). Only a node
        itself may say it leaves (`caller`: the member calling, authenticated by mutual TLS; None without a key)."""
        if caller is not None and caller != node_id:
            return
        if self._peers.pop(node_id, None) is not None:
            self.log.info("peer %s is leaving", node_id)
            self.counters["peers_left"] += 1
