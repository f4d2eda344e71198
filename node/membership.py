"""Keeps the node's view of its peers: discovery proposes addresses, a gRPC HealthCheck confirms them."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Protocol

import grpc

from . import wire
from .node import Node

log = logging.getLogger(__name__)


class Discovery(Protocol):
    def candidates(self) -> list[str]: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


class Membership:
    """Health-checks every candidate each interval; the peers that answer are the node's topology."""

    def __init__(self, node: Node, discoveries: list[Discovery], interval: float = 1.0, check_timeout: float = 1.0):
        self.node, self.discoveries = node, discoveries
        self.interval, self.check_timeout = interval, check_timeout
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()

    async def start(self) -> None:
        for d in self.discoveries:
            await d.start()
        self._task = asyncio.create_task(self._loop(), name="membership")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for d in self.discoveries:
            await d.stop()

    async def wait_for_peers(self, n: int) -> None:
        while len(self.node.known_peers) < n:
            self._changed.clear()
            await self._changed.wait()

    async def _loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval)

    async def refresh(self) -> None:
        candidates = [a for d in self.discoveries for a in d.candidates()]
        addresses = [a for a in dict.fromkeys(candidates) if a != self.node.settings.address]
        infos = await asyncio.gather(*(self._check(a) for a in addresses))
        peers = {}
        for address, info in zip(addresses, infos):
            if info is not None and info.node_id != self.node.id:
                # Reach the peer where we found it, whatever address it believes it has.
                peers[info.node_id] = dataclasses.replace(info, address=address)
        for gone in self.node.known_peers.keys() - peers.keys():
            log.info("peer %s left", gone)
            self.node.counters["peers_left"] += 1
        for new in peers.keys() - self.node.known_peers.keys():
            log.info("peer %s joined at %s", new, peers[new].address)
            self.node.counters["peers_joined"] += 1
        self.node.known_peers = peers
        self._changed.set()

    async def _check(self, address: str):
        try:
            response = await self.node.peers.get(address).health_check(self.check_timeout)
            return wire.decode_node_info(response.node) if response.ok else None
        except grpc.aio.AioRpcError:
            return None
        except wire.WireError as e:
            log.warning("peer at %s sent a bad HealthCheck answer: %s", address, e)
            return None
