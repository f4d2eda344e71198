"""One long-lived gRPC stream per peer for the data path: messages go out in order, back to back, and the peer's
answers come back in order, each answering one or more of them.

A unary call per message costs a new HTTP/2 stream (headers both ways, a task on each side): in Python that is a
few hundred microseconds per hop, per token. A stream opened once carries every message to that peer, in order,
for the price of a frame. Waiting for each message's answer before the next would add a round trip per message
and an answer per message: `post` returns once a message is written (with a future for its answer), so the next
goes at once, and the peer may answer several messages with one response (`answers`: how many, in order;
node/grpc/server.py answers a message with refusals at once, the others a few at a time). On a node with one core
nothing overlaps, so every answer not sent is time every token gets back.

Every message has a deadline: an answer that doesn't come within `timeout` ends the stream (it is suspect, and the
ones behind it would wait just as long) and fails everything waiting on it; the next send opens a fresh stream.
One timer per stream watches the oldest message, not one per message. At most `max_in_flight` messages wait for
answers; the next waits for room. Streams are also replaced after `max_age` seconds (when none waits), so none
outlives its TLS handshake's certificates for long.
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
MAX_IN_FLIGHT = 256  # messages written and not yet answered, per stream


class StreamBroken(Exception):
    """The stream ended (or was ended) before this message got its answer; `code` is gRPC's status, if any."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name} {details}")
        self.code, self.details = code, details


class PeerStream:
    def __init__(
        self,
        open_call: Callable[[], Any],
        timeout: float,
        max_age: float = 600.0,
        max_in_flight: int = MAX_IN_FLIGHT,
    ):
        """`open_call()` starts the stream-stream call (with wait_for_ready, so a peer still starting is waited
        for, within the message deadline)."""
        self.open_call, self.timeout, self.max_age, self.max_in_flight = open_call, timeout, max_age, max_in_flight
        self.call: Any = None
        self.opened = 0.0
        self.waiting: deque[tuple[asyncio.Future, float]] = deque()  # (answer, when it was sent), in order
        self.reader: asyncio.Task | None = None
        self.watch: asyncio.TimerHandle | None = None  # the deadline of waiting[0]
        self.room = asyncio.Event()  # set while fewer than max_in_flight wait
        self.room.set()
        self.lock = asyncio.Lock()  # one writer at a time keeps the waiters in the order of the messages

    async def send(self, message: Any) -> Any:
        """Write `message` and wait for its answer (None: the peer answered it with a later message's response)."""
        return await (await self.post(message))

    async def post(self, message: Any) -> asyncio.Future:
        """Write `message` after every earlier one; returns once it is written, with the future of its answer (the
        peer's response, or None for a message answered by a later one's). Raises StreamBroken when it can't be
        written; the future fails with StreamBroken when the stream ends before the answer."""
        async with self.lock:
            if len(self.waiting) >= self.max_in_flight:
                self.room.clear()
                try:
                    async with asyncio.timeout(self.timeout):
                        await self.room.wait()
                except TimeoutError:
                    self._close(StreamBroken(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self.timeout:g}s"))
            if self.call is None or time.monotonic() - self.opened > self.max_age and not self.waiting:
                self._open()
            answer = asyncio.get_running_loop().create_future()
            self.waiting.append((answer, time.monotonic()))  # before the write: its answer may come before it returns
            if self.watch is None:
                self.watch = asyncio.get_running_loop().call_later(self.timeout, self._check)
            try:
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
        if answer.done() and answer.exception() is not None:
            raise answer.exception()
        return answer

    def _check(self) -> None:
        """The deadline of the oldest message waiting: passed (the stream ends), or re-armed for the next one."""
        self.watch = None
        if not self.waiting:
            return
        left = self.waiting[0][1] + self.timeout - time.monotonic()
        if left <= 0:
            self._close(StreamBroken(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self.timeout:g}s"))
        else:
            self.watch = asyncio.get_running_loop().call_later(left, self._check)

    def _open(self) -> None:
        self._close(StreamBroken(grpc.StatusCode.UNAVAILABLE, "stream replaced"))
        self.call = self.open_call()
        self.opened = time.monotonic()
        self.reader = asyncio.ensure_future(self._read(self.call))

    async def _read(self, call: Any) -> None:
        error = StreamBroken(grpc.StatusCode.UNAVAILABLE, "the peer closed the stream")
        try:
            async for response in call:
                if call is not self.call:
                    break
                n = getattr(response, "answers", 0) or 1  # 0: a peer that answers each message alone
                if n > len(self.waiting):
                    error = StreamBroken(grpc.StatusCode.INTERNAL, f"answered {n} messages, {len(self.waiting)} sent")
                    break
                for i in range(n):
                    waiter = self.waiting.popleft()[0]
                    if not waiter.done():
                        waiter.set_result(response if i == n - 1 else None)
                if len(self.waiting) < self.max_in_flight:
                    self.room.set()
        except grpc.aio.AioRpcError as e:
            error = StreamBroken(e.code(), e.details() or "")
        except asyncio.CancelledError:
            error = StreamBroken(grpc.StatusCode.CANCELLED, "stream closed")
        finally:
            if call is self.call:
                self._close(error)

    def _close(self, error: StreamBroken) -> None:
        call, self.call = self.call, None
        while self.waiting:
            waiter = self.waiting.popleft()[0]
            if not waiter.done():
                waiter.set_exception(error)
        self.room.set()
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None
        if call is not None:
            call.cancel()

    async def close(self) -> None:
        self._close(StreamBroken(grpc.StatusCode.CANCELLED, "closed"))
        if self.reader is not None:
            await asyncio.gather(self.reader, return_exceptions=True)
