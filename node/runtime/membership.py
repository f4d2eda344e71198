"""Keeps the node's view of its peers: discovery proposes addresses, a health check over the transport confirms them."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol

from node.core.topology import NodeInfo
from node.runtime.transport import Transport, TransportError

log = logging.getLogger(__name__)


class Discovery(Protocol):
    def candidates(self) -> list[str]: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


class Membership:
    """Health-checks every candidate each interval and reports to `on_change` the peers that answered and are not
    draining (the members new plans may use), and the address of every peer that answered (alive, draining ones
    included).

    Membership also decides which addresses the node still reaches: the transport keeps a connection (a channel, a
    data-path stream and its reader task) per address it was asked to call, and is told to `forget` every address
    that did not answer this round or is no longer proposed. So an address that never answers holds nothing between
    checks, and a peer that left (a `Leave`, then silence) or vanished is let go once it stops answering. A peer
    that is draining still answers: its connection stays while it finishes the requests it has with us."""

    def __init__(self, self_id: str, self_address: str, transport: Transport, discoveries: list[Discovery],
                 on_change: Callable[[dict[str, NodeInfo], dict[str, str]], None], interval: float = 1.0,
                 check_timeout: float = 1.0):
        self.self_id, self.self_address, self.transport = self_id, self_address, transport
        self.discoveries, self.on_change = discoveries, on_change
        self.interval, self.check_timeout = interval, check_timeout
        self.peers: dict[str, NodeInfo] = {}
        self.reached: set[str] = set()  # the addresses that answered the last round: the transport may keep these
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
        while len(self.peers) < n:
            self._changed.clear()
            await self._changed.wait()

    async def _loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval)

    async def refresh(self) -> None:
        candidates = [a for d in self.discoveries for a in d.candidates()]
        addresses = [a for a in dict.fromkeys(candidates) if a != self.self_address]
        infos = await asyncio.gather(*(self._check(a) for a in addresses))
        peers, alive, reached = {}, {}, set()
        for address, info in zip(addresses, infos):
            if info is not None and info.node_id != self.self_id:
                alive[info.node_id] = address
                reached.add(address)
                if not info.draining:
                    # Reach the peer where we found it, whatever address it believes it has.
                    peers[info.node_id] = dataclasses.replace(info, address=address)
        self.peers = peers
        self.on_change(peers, alive)  # first: requests that used a lost peer are failed before its channel closes
        dropped = (set(addresses) | self.reached) - reached
        self.reached = reached
        await asyncio.gather(*(self.transport.forget(a) for a in dropped))
        self._changed.set()

    async def _check(self, address: str) -> NodeInfo | None:
        try:
            return await self.transport.health_check(address, self.check_timeout)
        except TransportError as e:
            if e.kind == "malformed":
                log.warning("peer at %s sent a bad HealthCheck answer: %s", address, e)
            return None
