"""Keeps the node's view of its peers: discovery proposes addresses, a health check over the transport confirms them."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Protocol

from node.core.logs import node_log
from node.core.topology import NodeInfo
from node.runtime.transport import Transport, TransportError

STARTUP_PROBE = 0.2  # seconds between rounds while a proposed peer has never answered, early on
STARTUP_WINDOW = 30.0  # seconds after start during which such a peer is probed that often


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
    that is draining still answers: its connection stays while it finishes the requests it has with us.

    A busy peer is not a dead one: a peer that answered before and now lets a check time out (its event loop held
    by a burst of work, a slow link) keeps its place, as it last answered, until it has missed `misses` checks in a
    row; one whose connection is refused or closed (a process killed, a port shut) is dropped at the first miss.
    So a peer stalled for less than `misses` x (interval + check_timeout) never flaps membership, and never has
    its requests replayed or its channel closed under calls in flight."""

    def __init__(
        self,
        self_id: str,
        self_address: str,
        transport: Transport,
        discoveries: list[Discovery],
        on_change: Callable[[dict[str, NodeInfo], dict[str, str]], None],
        interval: float = 1.0,
        check_timeout: float = 1.0,
        misses: int = 2,
    ):
        if misses < 1:
            raise ValueError(f"misses must be >= 1, got {misses}")
        self.self_id, self.self_address, self.transport = self_id, self_address, transport
        self.discoveries, self.on_change = discoveries, on_change
        self.interval, self.check_timeout, self.misses = interval, check_timeout, misses
        self.peers: dict[str, NodeInfo] = {}
        self.reached: set[str] = set()  # the addresses that answered the last round: the transport may keep these
        self.answered: dict[str, NodeInfo] = {}  # address -> what it said the last time it answered
        self.missed: dict[str, int] = {}  # address -> checks timed out in a row since
        self.proposed: list[str] = []  # the addresses the discoveries proposed last round
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self.log = node_log(__name__, self_id)

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
        started = asyncio.get_running_loop().time()
        while True:
            await self.refresh()
            await asyncio.sleep(self.pause(asyncio.get_running_loop().time() - started))

    def pause(self, since_start: float) -> float:
        """Seconds until the next round: `interval`, or STARTUP_PROBE in the first STARTUP_WINDOW seconds while a
        proposed address has never answered. Why: nodes of a cluster start within a second or two of each other,
        and a peer that is not up yet at one round waited a whole interval for the next, so a cluster took up to
        an interval longer to form than its slowest node took to start."""
        unheard = any(a not in self.answered for a in self.proposed)
        return min(self.interval, STARTUP_PROBE) if unheard and since_start < STARTUP_WINDOW else self.interval

    async def refresh(self) -> None:
        candidates = [a for d in self.discoveries for a in d.candidates()]
        addresses = self.proposed = [a for a in dict.fromkeys(candidates) if a != self.self_address]
        infos = [
            self._tolerate(a, result)
            for a, result in zip(addresses, await asyncio.gather(*(self._check(a) for a in addresses)))
        ]
        for gone in self.answered.keys() - set(addresses):  # no longer proposed: nothing to remember of it
            self.answered.pop(gone)
            self.missed.pop(gone, None)
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

    def _tolerate(self, address: str, result: NodeInfo | TransportError) -> NodeInfo | None:
        """What counts as `address`'s answer this round: its own, or while it is only slow (a timeout, fewer than
        `misses` in a row, after a real answer), the last one it gave."""
        if not isinstance(result, TransportError):
            self.answered[address] = result
            self.missed.pop(address, None)
            return result
        last = self.answered.get(address)
        missed = self.missed[address] = self.missed.get(address, 0) + 1
        if result.how == "timeout" and last is not None and missed < self.misses:
            self.log.info(
                "peer at %s did not answer within %gs (%d of %d misses tolerated)",
                address,
                self.check_timeout,
                missed,
                self.misses - 1,
            )
            return last
        self.answered.pop(address, None)
        self.missed.pop(address, None)
        return None

    async def _check(self, address: str) -> NodeInfo | TransportError:
        try:
            return await self.transport.health_check(address, self.check_timeout)
        except TransportError as e:
            if e.how == "malformed":
                self.log.warning("peer at %s sent a bad HealthCheck answer: %s", address, e)
            return e
