"""The one chat path every API dialect shares: a typed ChatRequest in, typed events out.

`Api.chat_run` (node/http/api.py) renders, constrains, admits and generates a ChatRequest once for every dialect
(OpenAI chat, Ollama, Anthropic Messages, OpenAI Responses); a dialect only translates its body into a ChatRequest
and these events back into its own shapes. `ChatEvents` is pure: the generated text pieces -> text, tool calls and
one closing `Finished`, so a dialect's streamed and whole answers are folds of the same events and cannot disagree.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from node.http.completion import TextDelta
from node.http.schema import ApiError, ChatRequest, parse_chat
from node.http.tools import Structure, ToolCall, ToolCallParser

if TYPE_CHECKING:
    from node.runtime.node import Node

log = logging.getLogger(__name__)
WRITE_TIMEOUT_S = 30


@dataclass(frozen=True)
class TextOut:
    text: str


@dataclass(frozen=True)
class CallOut:
    call: ToolCall  # arguments: a JSON string

    @property
    def arguments(self) -> Any:
        return json.loads(self.call.arguments)


@dataclass(frozen=True)
class Finished:
    """Always the last event. `reason`: stop | length | tool_calls (a reply that called tools and then stopped);
    `stop_sequence`: the client's stop string that ended it, if one did."""

    reason: str
    completion_tokens: int
    stop_sequence: str | None = None


Event = TextOut | CallOut | Finished


class ChatEvents:
    """Text pieces -> events. With tools the text is split into content and calls as it streams
    (ToolCallParser); without, every piece's text is content."""

    def __init__(self, structure: Structure):
        self.parser = ToolCallParser(structure.syntax.call_family) if structure.calls_tools else None
        self.called = False

    def feed(self, piece: TextDelta) -> list[Event]:
        final = piece.finish_reason is not None
        if self.parser is None:
            text, calls = piece.text, []
        else:
            text, calls = self.parser.feed(piece.text, final=final)
        out: list[Event] = [TextOut(text)] if text else []
        out += [CallOut(c) for c in calls]
        self.called |= bool(calls)
        if final:
            reason = "tool_calls" if self.called and piece.finish_reason == "stop" else piece.finish_reason
            out.append(Finished(reason, piece.completion_tokens, piece.stop_sequence))
        return out


class ChatApi(Protocol):
    """What a dialect (node/http/ollama.py, anthropic.py, responses.py) uses of the entry's API (node/http/api.py
    `Api`): its node and model, the model check, and the one chat path every dialect shares."""

    node: Node

    @property
    def model_id(self) -> str: ...

    def check_model(self, model: str) -> None: ...

    def chat_run(self, req: ChatRequest, endpoint: str = "chat") -> AbstractAsyncContextManager[ChatRun]: ...


@dataclass(frozen=True)
class ChatRun:
    """One admitted chat request: its prompt's size and its text pieces (the first already generated, so a
    failure before any token was an HTTP error, not a broken stream)."""

    prompt_tokens: int
    structure: Structure
    pieces: AsyncIterator[TextDelta]

    async def events(self) -> AsyncIterator[Event]:
        translate, finished = ChatEvents(self.structure), False
        async for piece in self.pieces:
            for event in translate.feed(piece):
                finished |= isinstance(event, Finished)
                yield event
        if not finished:  # the ring ended without a reason: say so rather than leave the client waiting
            yield Finished("stop", 0)


async def write(request: web.Request, response: web.StreamResponse, data: bytes) -> None:
    """A client that stops reading must not hold its generation slot: after WRITE_TIMEOUT_S the request is
    cancelled like a disconnect (the CancelledError unwinds the generation and ends it on every node). While the
    transport holds nothing unsent (the client keeps up: every token's usual case), a write well under its
    high-water mark can't pause it, so it needs no timer."""
    transport = request.transport
    if (
        transport is not None
        and not transport.is_closing()
        and transport.get_write_buffer_size() == 0
        and len(data) < transport.get_write_buffer_limits()[1] // 2
    ):
        await response.write(data)
        return
    try:
        async with asyncio.timeout(WRITE_TIMEOUT_S):
            await response.write(data)
    except TimeoutError:
        log.warning("client stopped reading its stream for %ss: cancelling the request", WRITE_TIMEOUT_S)
        raise asyncio.CancelledError from None


async def stream(
    request: web.Request,
    content_type: str,
    chunks: AsyncIterator[bytes],
    error: Callable[[ApiError], bytes],
) -> web.StreamResponse:
    """Send `chunks` as they come. Once the stream has started, whatever goes wrong reaches the client in-band,
    as the dialect's `error` chunk, and the stream ends: a client never waits on a stream cut short without a
    word."""
    response = web.StreamResponse(headers={"Content-Type": content_type, "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        async for data in chunks:
            await write(request, response, data)
    except ApiError as e:
        await write(request, response, error(e))
    except (ConnectionError, asyncio.CancelledError):
        raise  # the client is gone: nothing can reach it
    except Exception:  # a bug after the first chunk: still an error chunk, never a stream cut short
        log.exception("stream of %s %s failed", request.method, request.path)
        await write(request, response, error(ApiError(500, "internal server error")))
    await response.write_eof()
    return response


class EventBuilder(Protocol):
    """A dialect's answer built from the chat events (node/http/anthropic.py MessageBuilder, responses.py
    ResponseBuilder): its opening events, the events each chat event becomes, and the whole body at the end."""

    def start(self) -> list[tuple[str, Any]]: ...

    def feed(self, event: Event) -> list[tuple[str, Any]]: ...

    @property
    def body(self) -> dict[str, Any]: ...


async def reply(
    request: web.Request, run: ChatRun, builder: EventBuilder, streamed: bool, error: Callable[[ApiError], bytes]
) -> web.StreamResponse:
    """A named-event dialect's reply: the whole body when not streamed, else its events as server-sent events."""
    if not streamed:
        async for event in run.events():
            builder.feed(event)
        return web.json_response(builder.body)

    async def events() -> AsyncIterator[bytes]:
        for name, data in builder.start():
            yield sse(data, name)
        async for event in run.events():
            for name, data in builder.feed(event):
                yield sse(data, name)

    return await stream(request, "text/event-stream", events(), error)


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event (`event:` named, as Anthropic and the Responses API send them)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "").encode() + f"data: {payload}\n\n".encode()


def parse_translated(body: dict[str, Any], names: Mapping[str, str]) -> ChatRequest:
    """`parse_chat` of a dialect's body translated into OpenAI's, so every dialect is validated by the same code;
    an error names the dialect's field (`names`: OpenAI's name -> the dialect's), not ours."""
    try:
        return parse_chat(body)
    except ApiError as e:
        message = e.message
        for ours, theirs in names.items():
            message = message.replace(f"'{ours}'", f"'{theirs}'")
        param = names.get(e.param, e.param) if e.param else e.param
        raise ApiError(e.status, message, param=param, code=e.code) from None


def tool_choice_body(choice: str) -> str | dict[str, Any]:
    """A Structure's tool_choice (none | auto | required | a tool's name) as the OpenAI field says it."""
    return choice if choice in ("none", "auto", "required") else {"type": "function", "function": {"name": choice}}
