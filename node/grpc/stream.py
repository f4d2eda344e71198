"""One long-lived gRPC stream per peer for the data path: messages go out in order, and most are never answered.

A unary call per message costs a new HTTP/2 stream (headers both ways, a task on each side): in Python that is a
few hundred microseconds per hop, per token. A stream opened once carries every message to that peer, in order,
for the price of a frame. An answer per message would cost a frame back, and gRPC's write of it on the receiving
node sits between the message and the pass that runs it. So messages are *quiet* (`post`): the peer answers one
only when it refuses part of it. Every `ask_every` seconds a message asks for its answer (or, with nothing to
send, an empty one does), and since answers come in order, an answer to message n answers every message before it:
the ones it names nothing of took everything.

Every message has a deadline: an asked answer that doesn't come within `timeout` ends the stream (it is suspect,
and the ones behind it would wait just as long) and fails every message not answered yet; the next message opens
a fresh stream. So a message is answered, or fails, within `ask_every + timeout` of its write. Streams are also
replaced after `max_age` seconds, so none outlives its TLS handshake's certificates for long.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

from node.grpc.generated import node_service_pb2 as pb

log = logging.getLogger(__name__)
ASK_EVERY = 1.0  # seconds a quiet message waits at most before a message asks for an answer that covers it

# Called once per message: with its answer, None when a later message's answer covered it (nothing of it was
# refused), or the StreamBroken that ended the stream before either.
OnAnswer = Callable[[Any], None]


class StreamBroken(Exception):
    """The stream ended (or was ended) before this message got its answer; `code` is gRPC's status, if any."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name} {details}")
        self.code, self.details = code, details


class PeerStream:
    def __init__(
        self, open_call: Callable[[], Any], timeout: float, max_age: float = 600.0, ask_every: float = ASK_EVERY
    ):
        """`open_call()` starts the stream-stream call (with wait_for_ready, so a peer still starting is waited
        for, within the message deadline)."""
        self.open_call, self.timeout, self.max_age, self.ask_every = open_call, timeout, max_age, ask_every
        self.call: Any = None
        self.opened = 0.0
        self.seq = 0  # the last message's number (they start at 1 on every stream)
        self.unanswered: deque[tuple[int, OnAnswer]] = deque()
        self.asks: deque[tuple[int, float]] = deque()  # messages whose answers are awaited, and their deadlines
        self.ask_due = False  # the next message asks
        self.timer: asyncio.TimerHandle | None = None  # the first awaited answer's deadline, or when to ask
        self.reader: asyncio.Task | None = None
        self.lock = asyncio.Lock()  # one writer at a time keeps the messages in the order of the calls

    async def send(self, message: Any, on_write: Callable[[], None] | None = None) -> Any:
        """Writes `message` asking for its answer, and returns that answer (raises StreamBroken)."""
        answer = asyncio.get_running_loop().create_future()
        await self.post(message, lambda got: _settle(answer, got), on_write, ask=True)
        return await answer

    async def post(
        self, message: Any, on_answer: OnAnswer, on_write: Callable[[], None] | None = None, *, ask: bool = False
    ) -> None:
        """Writes `message` (a SendRequest: its `seq` and `quiet` are set here) after those of earlier calls; returns
        once gRPC took it. `on_answer` is called later, once (see OnAnswer); `on_write` as the message is handed
        to gRPC's write (the hop's counters: node/runtime/overhead.py)."""
        async with self.lock:
            if self.call is None or time.monotonic() - self.opened > self.max_age and not self.unanswered:
                self._open()
            self.seq += 1
            seq, ask = self.seq, ask or self.ask_due
            message.seq, message.quiet = seq, not ask
            self.unanswered.append((seq, on_answer))
            try:
                if on_write is not None:
                    on_write()
                # the write runs in this task (no task of its own), under its own deadline: a write that waits for a
                # peer that never comes (wait_for_ready) is given up by cancelling it here, which cancelling the
                # call does not do
                async with asyncio.timeout(self.timeout):
                    await self.call.write(message)
            except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
                code = getattr(e, "code", lambda: grpc.StatusCode.UNAVAILABLE)()
                self._close(StreamBroken(code, f"cannot send on the stream: {type(e).__name__}"))
                return
            except asyncio.CancelledError:
                # whether the message went out is unknown: nothing after it may count as covering it
                self._close(StreamBroken(grpc.StatusCode.CANCELLED, "the stream was closed mid-write"))
                if asyncio.current_task().cancelling():
                    raise
                return
            if ask:
                self.ask_due = False
                self.asks.append((seq, asyncio.get_running_loop().time() + self.timeout))
                if len(self.asks) == 1:
                    self._arm()
            elif not self.asks and self.timer is None:
                self._arm()

    def _arm(self) -> None:
        """The timer: the first awaited answer's deadline; else, with messages unanswered, when to ask."""
        if self.timer is not None:
            self.timer.cancel()
        loop = asyncio.get_running_loop()
        if self.asks:
            self.timer = loop.call_at(self.asks[0][1], self._overdue, self.asks[0][0])
        else:
            self.timer = loop.call_later(self.ask_every, self._ask) if self.unanswered else None

    def _ask(self) -> None:
        """`ask_every` after a quiet message went unanswered: the next message asks, and if none comes at once, an
        empty one does."""
        self.timer = None
        if not self.asks and self.unanswered:
            self.ask_due = True
            asyncio.ensure_future(self._ping())

    async def _ping(self) -> None:
        if self.ask_due and self.unanswered and self.call is not None:
            await self.post(pb.SendRequest(), lambda got: None, ask=True)

    def _overdue(self, seq: int) -> None:
        if self.asks and self.asks[0][0] == seq:  # fails this message and every one not answered: the stream is suspect
            self._close(StreamBroken(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self.timeout:g}s"))

    def _open(self) -> None:
        self._close(StreamBroken(grpc.StatusCode.UNAVAILABLE, "stream replaced"))
        self.call, self.seq = self.open_call(), 0
        self.opened = time.monotonic()
        self.reader = asyncio.ensure_future(self._read(self.call))

    async def _read(self, call: Any) -> None:
        error = StreamBroken(grpc.StatusCode.UNAVAILABLE, "the peer closed the stream")
        try:
            async for answer in call:
                if call is not self.call:
                    break
                self._answered(answer)
        except grpc.aio.AioRpcError as e:
            error = StreamBroken(e.code(), e.details() or "")
        except asyncio.CancelledError:
            error = StreamBroken(grpc.StatusCode.CANCELLED, "stream closed")
        finally:
            if call is self.call:
                self._close(error)

    def _answered(self, answer: Any) -> None:
        """An answer to message `answer.seq`, which answers every message before it too."""
        seq = answer.seq or (self.unanswered[0][0] if self.unanswered else 0)  # 0: a peer that numbers nothing
        while self.unanswered and self.unanswered[0][0] <= seq:
            n, on_answer = self.unanswered.popleft()
            _call(on_answer, answer if n == seq else None)
        if self.asks and self.asks[0][0] <= seq:
            while self.asks and self.asks[0][0] <= seq:
                self.asks.popleft()
            self._arm()
        elif self.timer is None:
            self._arm()

    def _close(self, error: StreamBroken) -> None:
        call, self.call = self.call, None
        self.asks.clear()
        self.ask_due = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        while self.unanswered:
            _call(self.unanswered.popleft()[1], error)
        if call is not None:
            call.cancel()

    async def close(self) -> None:
        self._close(StreamBroken(grpc.StatusCode.CANCELLED, "closed"))
        if self.reader is not None:
            await asyncio.gather(self.reader, return_exceptions=True)


def _call(on_answer: OnAnswer, got: Any) -> None:
    try:
        on_answer(got)
    except Exception:  # the stream goes on for the other messages
        log.exception("handling a peer's answer failed")


def _settle(future: asyncio.Future, got: Any) -> None:
    if future.done():
        return  # its sender was cancelled
    if isinstance(got, StreamBroken):
        future.set_exception(got)
    else:
        future.set_result(got)
