"""Where a ring's relayed rows meet their next inputs: the engine thread waits here for them, and the loop hands
them over as they come off the data link (or gRPC's stream), so a hop's next pass starts from the message, without
the core's queue, the worker's wake and a new trip to the engine thread.

The core decides what is relayed (`Row.relay`, node/core/request_book.py's `_plan`) and checks each input as it
checks every input (`RequestBook.relay_activations`, called under this inbox's lock: an input is either handed here
while the engine thread waits for it, or queued, never both, never neither). The engine thread waits while nothing
else is asked of it: new work, an ended request or shutdown (`interrupt`) ends the wait, and so does `wait_s`
without any input (a stalled peer; its input then comes through the queue). Once one input of several came, the
others get `gather_s` more: those that come later are queued, for the pass after.
"""

from __future__ import annotations

import _thread
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import numpy as np

R = TypeVar("R")
WAIT_S = 0.5  # longest the engine thread waits for a relayed row's next input (a peer's pass takes far less)
GATHER_S = 0.002  # once one input came, longest it waits for the others of the same pass


class RelayInbox:
    def __init__(self, current: Callable[[], bool], wait_s: float = WAIT_S, gather_s: float = GATHER_S):
        """`current()`: whether the engine thread's run may go on (false once interrupted)."""
        if wait_s < 0 or gather_s < 0:
            raise ValueError(f"waits are never negative, got {wait_s} and {gather_s} s")
        self.current, self.wait_s, self.gather_s = current, wait_s, gather_s
        self._lock = threading.Lock()  # the state below
        self._awaiting: dict[str, np.ndarray | None] = {}  # request -> its input once it came
        self._first: float | None = None  # when the first awaited input came (perf_counter)
        # what the waiting engine thread blocks on: held while nothing new happened, released once to wake it (a
        # bare lock, not a Condition: its wait and notify are Python, on cold caches on a ring's every hop)
        self._signal: _thread.LockType | None = None

    @property
    def waiting(self) -> bool:
        """Whether the engine thread waits for inputs none of which came yet (read on the loop, without the lock:
        what it says may be a moment old)."""
        return bool(self._awaiting) and self._first is None

    def wake(self) -> None:
        """Something changed `current()`: the engine thread looks again."""
        with self._lock:
            self._signalled()

    def _signalled(self) -> None:
        """(Under the lock.) The waiting engine thread woken, or told at once when it next blocks (never twice)."""
        if self._signal is not None and self._signal.locked():
            self._signal.release()

    def wait(self, requests: Iterable[str]) -> tuple[dict[str, np.ndarray], float]:
        """On the engine thread: the inputs that came for `requests` (none: the run ends), and the seconds waited
        before the first of them came (the ring's time, not this node's)."""
        began = time.perf_counter()
        signal = _thread.allocate_lock()
        signal.acquire()
        with self._lock:
            self._awaiting, self._first, self._signal = dict.fromkeys(requests), None, signal
        try:
            while True:
                with self._lock:
                    if not self.current() or all(v is not None for v in self._awaiting.values()):
                        break
                    until = began + self.wait_s if self._first is None else self._first + self.gather_s
                left = until - time.perf_counter()
                if left <= 0:
                    break
                signal.acquire(True, left)
        finally:
            with self._lock:
                inputs = {rid: data for rid, data in self._awaiting.items() if data is not None}
                idle = self._first - began if inputs and self._first is not None else 0.0
                self._awaiting, self._signal = {}, None
        return inputs, max(0.0, idle)

    def offer(
        self, take: Callable[[frozenset[str]], tuple[R, dict[str, np.ndarray]]]
    ) -> tuple[R, dict[str, np.ndarray]]:
        """On the loop: `take(awaited)` (the core taking a message's activations) with the requests whose input the
        engine thread waits for now; the inputs it hands back for them go to the engine thread."""
        with self._lock:
            awaited = frozenset(rid for rid, data in self._awaiting.items() if data is None)
            result, relayed = take(awaited)
            if stray := set(relayed) - awaited:
                raise ValueError(f"inputs relayed for requests {sorted(stray)} nobody waits for")
            if relayed:
                self._awaiting.update(relayed)
                if self._first is None:
                    self._first = time.perf_counter()
                self._signalled()
        if relayed:
            _yield()  # the engine thread, woken, takes the interpreter now, not when the loop next sleeps
        return result, relayed

    def hand(self, request_id: str, data: np.ndarray, take: Callable[[], bool]) -> bool:
        """On the loop: `data` handed to the engine thread as `request_id`'s input if it waits for that now and
        `take()` (the core taking it: `RequestBook.relay_row`) agrees; False, nothing handed, otherwise."""
        with self._lock:
            if request_id not in self._awaiting or self._awaiting[request_id] is not None or not take():
                return False
            self._awaiting[request_id] = data
            if self._first is None:
                self._first = time.perf_counter()
            self._signalled()
        _yield()
        return True


def _yield() -> None:
    """Let a thread waiting for the interpreter lock run: os.sched_yield releases it and gives up the core."""
    if hasattr(os, "sched_yield"):
        os.sched_yield()
    else:
        time.sleep(0)
