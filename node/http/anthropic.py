"""Anthropic's Messages API on the same port: POST /v1/messages, streamed (message_start ... message_stop) or not.

The body (system, messages of text / tool_use / tool_result blocks, tools, tool_choice, stop_sequences,
output_config.format; temperature, top_p and top_k, which older clients send) is
translated into the OpenAI chat body and parsed by the same code (node/http/chat.py), so it is generated,
constrained and refused exactly as /v1/chat/completions is; every error is an Anthropic error object. The
streamed events and the whole message are built from the same typed events by `MessageBuilder`, so they agree.
"""

from __future__ import annotations

import functools
import json
import uuid
from typing import Any

from aiohttp import web

from node.http import chat
from node.http.chat import CallOut, ChatApi, Event, TextOut
from node.http.schema import ApiError, ChatRequest, read_json

PATHS = ("/v1/messages",)
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
NAMES = {"stop": "stop_sequences", "response_format": "output_config.format"}


def error_body(e: ApiError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def error_response(e: ApiError) -> web.Response:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return web.json_response(error_body(e), status=e.status, headers=headers)


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


# -- a request -> ChatRequest -----------------------------------------------------------------------------------
def _text(value: Any, where: str) -> str:
    """A string, or text blocks (as system prompts and tool results may be)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(where, "must be a string or an array of text blocks")
    for j, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad(f"{where}[{j}]", "only text blocks are supported here")
    return "".join(block["text"] for block in value)


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI messages: tool results become tool messages (before the user's text),
    tool_use blocks an assistant message's tool_calls."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad(f"{where}.role", 'each message needs a "role" of "user" or "assistant"')
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content", "must be a string or an array of content blocks")
    text, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and m["role"] == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad(at, 'a tool_use block needs "id", "name" and "input"')
            if not isinstance(block.get("input", {}), dict):
                raise bad(f"{at}.input", "must be an object")
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            calls.append(
                {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        elif kind == "tool_result" and m["role"] == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad(f"{at}.tool_use_id", "a tool_result block needs the tool_use_id it answers")
            output = _text(block.get("content", ""), f"{at}.content")
            output = f"Error: {output}" if block.get("is_error") is True else output
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": output})
        else:
            raise bad(at, f"content block type {kind!r} is not supported in a {m['role']} message")
    if m["role"] == "assistant":
        return [{"role": "assistant", "content": "".join(text)} | ({"tool_calls": calls} if calls else {})]
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    tools = body.get("tools")
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise bad("tools", "must be an array")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            raise bad(f"tools[{i}]", "only client tools ({name, description, input_schema}) are supported")
        function = {"name": t.get("name"), "description": t.get("description", ""), "parameters": t.get("input_schema")}
        out.append({"type": "function", "function": function})
    fields: dict[str, Any] = {"tools": out}
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise bad("tool_choice", 'must be {"type": "auto" | "any" | "tool" | "none"}')
        named = {"type": "function", "function": {"name": choice.get("name")}}
        fields["tool_choice"] = named if kind == "tool" else {"any": "required"}.get(kind, kind)
        fields["parallel_tool_calls"] = choice.get("disable_parallel_tool_use") is not True
    return fields


def _output(body: dict[str, Any]) -> dict[str, Any]:
    """Structured output: `output_config.format` (or the older top-level `output_format`), a JSON schema the
    reply is constrained to. `output_config.effort` is a hint a model without thinking has no use for."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad("output_config", "must be an object")
    fmt = (config or {}).get("format", body.get("output_format"))
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad("output_config.format", 'must be {"type": "json_schema", "schema": {...}}')
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}}


def parse_messages(body: dict[str, Any]) -> ChatRequest:
    """A /v1/messages body -> the typed request (stream flag included)."""
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad("max_tokens", "a positive integer is required")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty array")
    if isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        raise bad("messages", "a final assistant message (a prefill to continue) is not supported")
    system = body.get("system")
    out = [{"role": "system", "content": _text(system, "system")}] if system else []
    for i, m in enumerate(messages):
        out += _message(m, i)
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not 0 <= temperature <= 1:
        raise bad("temperature", "must be between 0 and 1")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        raise bad("thinking", "extended thinking is not supported by this model")
    sampling = {k: body[k] for k in ("model", "temperature", "top_p", "top_k", "stream") if k in body}
    translated = sampling | {"messages": out, "max_tokens": max_tokens, **_tools(body), **_output(body)}
    if body.get("stop_sequences") is not None:
        if not isinstance(body["stop_sequences"], list):
            raise bad("stop_sequences", "must be an array of strings")
        translated["stop"] = body["stop_sequences"]
    try:
        return chat.parse_translated(translated, NAMES)
    except ApiError as e:
        raise ApiError(e.status, f"{e.param}: {e.message}" if e.param else e.message, e.param, e.code) from None


# -- events -> the message --------------------------------------------------------------------------------------
class MessageBuilder:
    """The Messages API's stream, event by event, and the whole message it adds up to."""

    def __init__(self, model: str, prompt_tokens: int):
        self.message: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex[:24]}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }
        self.open = False  # a text block is open

    @property
    def body(self) -> dict[str, Any]:
        return self.message

    def start(self) -> list[tuple[str, dict[str, Any]]]:
        return [("message_start", {"type": "message_start", "message": self.message | {"content": []}}), _PING]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if not self.open:
            return []
        self.open = False
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.message["content"]) - 1})]

    def _begin(self, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        self.message["content"].append(block)
        start = {"type": "content_block_start", "index": len(self.message["content"]) - 1, "content_block": block}
        return [("content_block_start", json.loads(json.dumps(start)))]  # a copy: the block still grows

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        index = len(self.message["content"]) - 1
        return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}

    def feed(self, event: Event) -> list[tuple[str, dict[str, Any]]]:
        if isinstance(event, TextOut):
            out = [] if self.open else self._begin({"type": "text", "text": ""})
            self.open = True
            self.message["content"][-1]["text"] += event.text
            return out + [self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, CallOut):
            out = self._close() + self._begin(
                {"type": "tool_use", "id": event.call.id, "name": event.call.name, "input": {}}
            )
            self.message["content"][-1]["input"] = event.arguments
            out.append(self._delta({"type": "input_json_delta", "partial_json": event.call.arguments}))
            return out + [
                ("content_block_stop", {"type": "content_block_stop", "index": len(self.message["content"]) - 1})
            ]
        reason = "stop_sequence" if event.stop_sequence else STOP_REASONS.get(event.reason, "end_turn")
        self.message |= {"stop_reason": reason, "stop_sequence": event.stop_sequence}
        self.message["usage"]["output_tokens"] = event.completion_tokens
        delta = {"stop_reason": reason, "stop_sequence": event.stop_sequence}
        return self._close() + [
            (
                "message_delta",
                {"type": "message_delta", "delta": delta, "usage": {"output_tokens": event.completion_tokens}},
            ),
            ("message_stop", {"type": "message_stop"}),
        ]


_PING = ("ping", {"type": "ping"})


async def messages(api: ChatApi, request: web.Request) -> web.StreamResponse:
    req = parse_messages(await read_json(request))
    if req.options.model != api.model_id:
        raise ApiError(404, f"model: '{req.options.model}' does not exist; this cluster serves '{api.model_id}'")
    async with api.chat_run(req, "anthropic") as run:
        builder = MessageBuilder(req.options.model, run.prompt_tokens)
        return await chat.reply(request, run, builder, req.options.stream, lambda e: chat.sse(error_body(e), "error"))


def routes(api: ChatApi) -> list[web.RouteDef]:
    return [web.post("/v1/messages", functools.partial(messages, api))]
