"""Messages for one peer, sent in order, one call at a time.

Whatever queues up while a call is in flight goes out together in the next call. Order matters: the chunks of a
prompt and the tokens of a stream must arrive as they were produced, and concurrent unary gRPC calls don't promise
that. Coalescing is the other gain: with many requests decoding, one call per step and peer instead of one per
request. A call carries at most `max_batch` items and `max_bytes` of them (as `size` counts them): the receiving
peer refuses messages larger than its model implies (node/grpc/client.py's `message_bound`), so a sender keeps
each call below it whatever queued up.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Outbox(Generic[T]):
    def __init__(
        self,
        send: Callable[[tuple[T, ...]], Awaitable[None]],
        spawn: Callable[[Awaitable[None]], object],
        on_idle: Callable[[], None],
        max_batch: int = 4096,
        *,
        max_bytes: int | None = None,
        size: Callable[[T], int] = lambda item: 0,
    ):
        """`send` makes one call with a batch and deals with its failure itself; `on_idle` runs when the outbox
        has sent everything (the owner may drop it). An item larger than `max_bytes` on its own goes alone."""
        self.send, self.spawn, self.on_idle, self.max_batch = send, spawn, on_idle, max_batch
        self.max_bytes, self.size = max_bytes, size
        self.pending: list[T] = []
        self.sending = False

    def put(self, *items: T) -> None:
        self.pending.extend(items)
        if not self.sending:
            self.sending = True
            self.spawn(self._drain())

    async def _drain(self) -> None:
        try:
            while self.pending:
                n = self._next_batch()
                batch, self.pending = tuple(self.pending[:n]), self.pending[n:]
                await self.send(batch)
        finally:
            self.sending = False
            if self.pending:  # cancelled mid-way (shutdown): nothing more will be sent
                self.pending.clear()
            self.on_idle()

    def _next_batch(self) -> int:
        """How many of the pending items the next call takes: at least one, at most `max_batch`, and no more than
        fit in `max_bytes`."""
        if self.max_bytes is None:
            return min(len(self.pending), self.max_batch)
        n, total = 0, 0
        for item in self.pending[: self.max_batch]:
            total += self.size(item)
            if n and total > self.max_bytes:
                break
            n += 1
        return n
