"""The entry's own stalls, as its waiting requests see them: after one, a silent request is presumed lost.

While an entry's event loop is held (a burst of work on it, the process stopped), its peers' health checks go
unanswered: they may count it gone, and what they owed it (a token, the failure that would have told it to replay)
is dropped. Nothing then reaches the entry, which would wait for a node's idle timeout (a minute) to fail the
request. A request waiting for its next message wakes every `slice_s`; a wake-up late by more than `tolerance_s`
is the entry's loop having stalled. A request that then stays silent for `grace_s` more is lost: the entry replays
it at once (replay is exact, so a needless one costs a prefill, never the text).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class LoopStalls:
    tolerance_s: float = 2.0  # a loop held this long may miss its peers' health checks (Membership: 1 s timeouts)
    grace_s: float = 1.0  # silence after a stall that makes a request lost
    slice_s: float = 0.5  # how often a waiting request looks at the clock
    clock: Callable[[], float] = time.monotonic
    last_stall: float = field(default=float("-inf"))  # when the latest stall was seen to end

    def __post_init__(self) -> None:
        if not (self.tolerance_s > 0 and self.grace_s > 0 and self.slice_s > 0):
            raise ValueError("loop stall tolerance, grace and slice must be positive")

    def woke(self, asleep_since: float) -> None:
        """A waiting request's slice ran out: it slept from `asleep_since`; record a stall if it woke late."""
        now = self.clock()
        if now - asleep_since - self.slice_s > self.tolerance_s:
            self.last_stall = now

    def lost(self, started: float, heard: float) -> bool:
        """Whether a request waiting since `started`, last heard from at `heard`, is lost: it was waiting through a
        recent stall (one within a grace and two slices: later silence is the plan's own pace, the idle timeouts'
        business) and has been silent for `grace_s` since the stall, or since the last message that still came."""
        now = self.clock()
        recent = now - self.last_stall <= self.grace_s + 2 * self.slice_s
        return started < self.last_stall and recent and now - max(heard, self.last_stall) >= self.grace_s
