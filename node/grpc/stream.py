"""One long-lived gRPC stream per peer for the data path: each `send` writes one message and awaits its answer.

A unary call per message costs a new HTTP/2 stream (headers both ways, a task on each side): in Python that is a
few hundred microseconds per hop, per token. A stream opened once carries every message to that peer, in order,
for the price of a frame each way. Order is the stream's: answers come back in the order the messages went out,
so the n-th answer resolves the n-th waiter.

Every message has a deadline: an answer that doesn't come within `timeout` ends the stream (it is suspect, and the
ones behind it would wait just as long) and fails everything waiting on it; the next send opens a fresh stream.
Streams are also replaced after `max_age` seconds, so none outlives its TLS handshake's certificates for long.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)


class StreamBroken(Exception):
    """The stream ended (or was ended) before this message got its answer; `code` is gRPC's status, if any."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name} {details}")
        self.code, self.details = code, details


class PeerStream:
    def __init__(self, open_call: Callable[[], Any], timeout: float, max_age: float = 600.0):
        """`open_call()` starts the stream-stream call (with wait_for_ready, so a peer still starting is waited
        for, within the message deadline)."""
        self.open_call, self.timeout, self.max_age = open_call, timeout, max_age
        self.call: Any = None
        self.opened = 0.0
        self.waiting: deque[asyncio.Future] = deque()
        self.reader: asyncio.Task | None = None
        self.lock = asyncio.Lock()  # one writer at a time keeps the waiters in the order of the messages

    async def send(self, message: Any, on_write: Callable[[], None] | None = None) -> Any:
        """The message's answer; `on_write` is called as the message is handed to gRPC's write (the hop's counters:
        what comes after is gRPC's own, node/runtime/overhead.py)."""
        async with self.lock:
            if self.call is None or time.monotonic() - self.opened > self.max_age and not self.waiting:
                self._open()
            answer = asyncio.get_running_loop().create_future()
            self.waiting.append(answer)
            try:
                if on_write is not None:
                    on_write()
                # the write runs in this task (no task of its own), under its own deadline: a write that waits for a
                # peer that never comes (wait_for_ready) is given up by cancelling it here, which cancelling the
                # call does not do
                async with asyncio.timeout(self.timeout):
                    await self.call.write(message)
            except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
                self._close(
                    StreamBroken(
                        getattr(e, "code", lambda: grpc.StatusCode.UNAVAILABLE)(),
                        f"cannot send on the stream: {type(e).__name__}",
                    )
                )
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise
                # the call was cancelled under us (the stream was closed): this message is lost with it
                self._close(StreamBroken(grpc.StatusCode.CANCELLED, "the stream was closed"))
        if answer.done():  # failed already (the write did not go out), or answered while the lock was released
            return answer.result()
        # one timer for the answer, not wait_for(shield(...)): an answer wakes this task in one callback, not three
        overdue = asyncio.get_running_loop().call_later(self.timeout, self._overdue, answer)
        try:
            return await answer
        finally:
            overdue.cancel()

    def _overdue(self, answer: asyncio.Future) -> None:
        if not answer.done():  # fails this answer and every one behind it: the stream is suspect
            self._close(StreamBroken(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self.timeout:g}s"))

    def _open(self) -> None:
        self._close(StreamBroken(grpc.StatusCode.UNAVAILABLE, "stream replaced"))
        self.call = self.open_call()
        self.opened = time.monotonic()
        self.reader = asyncio.ensure_future(self._read(self.call))

    async def _read(self, call: Any) -> None:
        error = StreamBroken(grpc.StatusCode.UNAVAILABLE, "the peer closed the stream")
        try:
            async for answer in call:
                if call is not self.call or not self.waiting:
                    break
                waiter = self.waiting.popleft()
                if not waiter.done():
                    waiter.set_result(answer)
        except grpc.aio.AioRpcError as e:
            error = StreamBroken(e.code(), e.details() or "")
        except asyncio.CancelledError:
            error = StreamBroken(grpc.StatusCode.CANCELLED, "stream closed")
        finally:
            if call is self.call:
                self._fail(error)
                self.call = None

    def _close(self, error: StreamBroken) -> None:
        call, self.call = self.call, None
        self._fail(error)
        if call is not None:
            call.cancel()

    def _fail(self, error: StreamBroken) -> None:
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    async def close(self) -> None:
        self._close(StreamBroken(grpc.StatusCode.CANCELLED, "closed"))
        if self.reader is not None:
            await asyncio.gather(self.reader, return_exceptions=True)
