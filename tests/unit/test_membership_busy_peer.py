"""A busy peer is not a dead one: a peer whose event loop is held for a moment keeps its membership (no flapping,
no replays, no channel closed under calls in flight); a peer that keeps missing checks, or whose port is shut, is
dropped."""

import asyncio
import threading
import time

from discovery.static import StaticDiscovery
from node.grpc.client import GrpcTransport
from node.runtime.membership import Membership
from tests.unit.test_peer_channels import serving


class PeerInAThread:
    """A real node on its own event loop in a thread, so the test can hold that loop busy (as a burst of parsing
    or a long step would) while the checking node's loop runs on."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.node, self.server, self.transport = self.call(serving("b"))

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def hold_loop(self, seconds: float) -> None:
        self.loop.call_soon_threadsafe(time.sleep, seconds)

    def close(self):
        async def stop():
            await self.server.stop(0)
            await self.node.stop()
            await self.transport.close()

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_a_peer_busy_for_less_than_the_tolerated_misses_stays_a_member_then_a_silent_one_is_dropped():
    peer = PeerInAThread()
    views = []

    async def go():
        transport = GrpcTransport(rpc_timeout=2.0)
        membership = Membership(
            "a",
            "127.0.0.1:1",
            transport,
            [StaticDiscovery([peer.node.address])],
            lambda peers, alive: views.append(sorted(peers)),
            check_timeout=0.3,
            misses=3,
        )
        await membership.refresh()
        peer.hold_loop(1.0)  # b is busy: its next two checks time out
        await asyncio.sleep(0.05)
        await membership.refresh()
        await membership.refresh()
        assert views == [["b"], ["b"], ["b"]], "a busy peer was dropped"
        assert transport.channels, "the channel to a busy peer was closed"
        await asyncio.sleep(1.0)
        await membership.refresh()  # b answers again: the count of misses starts over
        peer.hold_loop(1.5)
        await asyncio.sleep(0.05)
        for _ in range(3):
            await membership.refresh()
        assert views[-1] == [], "a peer silent for 3 checks in a row stays a member"
        await transport.close()

    try:
        asyncio.run(go())
    finally:
        peer.close()
