"""Messages for one peer, sent in order, one call at a time.

Whatever queues up while a call is in flight goes out together in the next call. Order matters: the chunks of a
prompt and the tokens of a stream must arrive as they were produced, and concurrent unary gRPC calls don't promise
that. Coalescing is the other gain: with many requests decoding, one call per step and peer instead of one per
request.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Outbox(Generic[T]):
    def __init__(self, send: Callable[[tuple[T, ...]], Awaitable[None]], spawn: Callable[[Awaitable[None]], object],
                 on_idle: Callable[[], None], max_batch: int = 4096):
        """`send` makes one call with a batch and deals with its failure itself; `on_idle` runs when the outbox
        has sent everything (the owner may drop it)."""
        self.send, self.spawn, self.on_idle, self.max_batch = send, spawn, on_idle, max_batch
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
                batch, self.pending = tuple(self.pending[: self.max_batch]), self.pending[self.max_batch:]
                await self.send(batch)
        finally:
            self.sending = False
            if self.pending:  # cancelled mid-way (shutdown): nothing more will be sent
                self.pending.clear()
            self.on_idle()
