"""Waiting for something asynchronous to become true, and failing with what was awaited when it doesn't.

Nodes, streams and discovery settle on their own time (health checks, releases, announcements): a test polls for
the state it needs instead of sleeping a guessed amount, and a timeout names the state that never came.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout: float, what: str, *, interval: float = 0.05) -> float:
    """Seconds until `predicate()` was true; an AssertionError saying `what` was awaited if it isn't within
    `timeout` seconds."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"waited {timeout} s for {what}; it never happened")
        time.sleep(interval)
    return time.monotonic() - start


async def wait_until_async(
    predicate: Callable[[], object], timeout: float, what: str, *, interval: float = 0.05
) -> float:
    """`wait_until` inside an event loop: sleeps with asyncio so the loop's own tasks (servers, streams) run."""
    start = time.monotonic()
    if not await holds_within(predicate, timeout, interval=interval):
        raise AssertionError(f"waited {timeout} s for {what}; it never happened")
    return time.monotonic() - start


async def holds_within(predicate: Callable[[], object], timeout: float, *, interval: float = 0.05) -> bool:
    """Whether `predicate()` became true within `timeout` seconds, for tests where not happening is an outcome
    (a node with the wrong key must never be found)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval)
    return True
