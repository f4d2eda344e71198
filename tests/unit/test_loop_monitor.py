"""The event loop's own latency is measured: a piece of work that holds the loop shows up as lag, in the
node's metrics and (rate-limited) in its log."""

import asyncio
import logging
import time

from node.runtime.loop_monitor import LoopMonitor
from tests.unit.test_node_rpc import serving, shutdown


def test_a_held_loop_is_measured_as_lag():
    lags = []

    async def go():
        monitor = asyncio.ensure_future(LoopMonitor(lags.append, interval=0.02).run())
        await asyncio.sleep(0.1)
        time.sleep(0.3)  # work that holds the loop
        await asyncio.sleep(0.1)
        monitor.cancel()

    asyncio.run(go())
    assert max(lags) >= 0.25 and sorted(lags)[len(lags) // 2] < 0.05


def test_long_lags_are_logged_once_per_period_with_the_worst(caplog):
    now = [0.0]
    monitor = LoopMonitor(lambda lag: None, warn_after=0.5, log_every=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "node.runtime.loop_monitor"):
        for t, lag in [(1, 0.1), (2, 0.7), (3, 2.0), (4, 0.9), (15, 0.6)]:
            now[0] = t
            monitor.record(lag)
    assert [r.getMessage()[:44] for r in caplog.records] == [
        "the event loop was held for 0.70s (the worst",
        "the event loop was held for 2.00s (the worst",
    ]


def test_a_node_exports_its_loop_lag():
    async def go():
        node, server, peer = await serving()
        try:
            await asyncio.sleep(0.15)
            time.sleep(0.3)
            await asyncio.sleep(0.25)
            samples = {
                s.name: s.value
                for m in node.metrics.registry.collect()
                for s in m.samples
                if m.name == "exo_event_loop_lag_seconds"
            }
        finally:
            await shutdown(node, server, peer)
        assert samples["exo_event_loop_lag_seconds_count"] >= 2
        assert samples["exo_event_loop_lag_seconds_sum"] >= 0.25

    asyncio.run(go())
