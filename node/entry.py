"""The entry side of a request: fix its plan, send the prompt to the first node, hand the caller the tokens that
come back, and make sure every node of the plan forgets the request when it ends, however it ends."""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable

import numpy as np

from shards.sampling import SamplingParams

from .plan import PlanStep, RequestSpec
from .requests import GenerationError, TokenMessage
from .transport import Transport, TransportError

log = logging.getLogger(__name__)


class Entry:
    def __init__(self, node_id: str, address: str, transport: Transport, plan: Callable[[], tuple[PlanStep, ...]],
                 stop_token_ids: frozenset[int], request_timeout: float, counters: Counter[str],
                 spawn: Callable[..., object]):
        self.node_id, self.address, self.transport, self.plan = node_id, address, transport, plan
        self.stop_token_ids, self.request_timeout = stop_token_ids, request_timeout
        self.counters, self.spawn = counters, spawn
        self.inbox: dict[str, asyncio.Queue[TokenMessage]] = {}  # requests we are the entry node of

    async def generate(self, prompt: list[int], sampling: SamplingParams, max_tokens: int) -> AsyncIterator[TokenMessage]:
        """Run one request through the ring, yielding tokens as the last node samples them.

        Whatever way this ends (finished, failed, or the consumer went away), every node of the plan is told to
        free the request's state.
        """
        spec = RequestSpec(
            request_id=uuid.uuid4().hex,
            plan=self.plan(),
            sampling=sampling,
            max_tokens=max_tokens,
            stop_token_ids=self.stop_token_ids,
            entry_node_id=self.node_id,
            entry_address=self.address,
        )
        inbox = self.inbox[spec.request_id] = asyncio.Queue()
        reason = "cancelled"
        self.counters["requests"] += 1
        try:
            try:
                await self.transport.send_prompt(spec.first.address, spec, np.asarray(prompt, np.int64))
            except TransportError as e:
                raise GenerationError(f"first node {spec.first.node_id}: {e}") from None
            while True:
                try:
                    message = await asyncio.wait_for(inbox.get(), self.request_timeout)
                except asyncio.TimeoutError:
                    raise GenerationError(f"no token within {self.request_timeout:g}s") from None
                if message.finish_reason == "error":
                    raise GenerationError(message.error or "request failed")
                yield message
                if message.finished:
                    reason = "finished"
                    return
        except GenerationError:
            reason = "failed"
            self.counters["requests_failed"] += 1
            raise
        finally:
            self.inbox.pop(spec.request_id, None)
            self.spawn(self._end_everywhere(spec, reason))

    def accept_tokens(self, message: TokenMessage) -> None:
        inbox = self.inbox.get(message.request_id)
        if inbox is not None:
            inbox.put_nowait(message)

    @property
    def active(self) -> int:
        return len(self.inbox)

    async def _end_everywhere(self, spec: RequestSpec, reason: str) -> None:
        async def end(step: PlanStep) -> None:
            try:
                await self.transport.end_request(step.address, spec.request_id, reason)
            except TransportError as e:
                log.warning("EndRequest %s to %s failed: %s", spec.request_id, step.node_id, e)

        await asyncio.gather(*(end(step) for step in spec.plan))
