"""How late the node's event loop runs: everything on it (the API, gRPC's handlers, health checks, the pipeline's
actions) waits while one piece of work holds it, so a held loop is what makes peers drop a live node.

A task asks to wake every `interval` seconds and records how much later than asked it woke: the loop's lag. The
lags go to a Prometheus histogram (`exo_event_loop_lag_seconds`); lags over `warn_after` are logged, at most once
per `log_every` seconds, with the worst since the last line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class LoopMonitor:
    def __init__(
        self,
        observe: Callable[[float], None],
        *,
        interval: float = 0.1,
        warn_after: float = 0.5,
        log_every: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`observe(lag_seconds)` hears every measurement."""
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.observe, self.interval, self.warn_after, self.log_every = observe, interval, warn_after, log_every
        self.clock = clock
        self.worst = 0.0  # the worst lag not yet logged
        self._logged = float("-inf")

    async def run(self) -> None:
        while True:
            asked = self.clock()
            await asyncio.sleep(self.interval)
            self.record(max(0.0, self.clock() - asked - self.interval))

    def record(self, lag: float) -> None:
        self.observe(lag)
        if lag < self.warn_after:
            return
        self.worst = max(self.worst, lag)
        now = self.clock()
        if now - self._logged >= self.log_every:
            log.warning(
                "the event loop was held for %.2fs (the worst lag since the last warning): health checks and "
                "the API waited that long",
                self.worst,
            )
            self._logged, self.worst = now, 0.0
