"""OpenAI's Responses API on the same port: POST /v1/responses, streamed (response.created ... response.completed)
or not. Nothing is stored: a response cannot be fetched, continued (`previous_response_id`) or run in the
background; a client sends the whole conversation as input items, as with `store: false`.

The body (input messages, function_call and function_call_output items, instructions, function tools,
`text.format`) is translated into the OpenAI chat body and parsed by the same code (node/http/chat.py), so it is
generated, constrained and refused exactly as /v1/chat/completions is; errors are OpenAI error objects. The
streamed events and the whole response are built from the same typed events by `ResponseBuilder`.
"""

from __future__ import annotations

import copy
import functools
import time
import uuid
from typing import Any

from aiohttp import web

from node.http import chat
from node.http.chat import CallOut, ChatApi, Event, TextOut
from node.http.schema import ApiError, ChatRequest, bad, read_json

NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format"}
STATELESS = {  # fields that need state kept between requests, which this server doesn't keep
    "previous_response_id": "send the whole conversation as 'input' items instead",
    "conversation": "send the whole conversation as 'input' items instead",
    "background": "background responses need a stored response to poll",
    "prompt": "stored prompt templates are not kept here; send 'instructions' and 'input'",
}
TEXT_PARTS = ("input_text", "output_text", "text")


# -- a request -> ChatRequest -----------------------------------------------------------------------------------
def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(where, f"'{where}' must be a string or an array of text parts")
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad(f"{where}[{j}]", "only text parts (input_text, output_text) are supported")
    return "".join(part["text"] for part in value)


def _input(value: Any) -> list[dict[str, Any]]:
    """Input items as OpenAI chat messages: consecutive function_call items make one assistant message's calls."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input", "'input' must be a string or a non-empty array of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            out.append({"role": item["role"], "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise bad(where, 'a function_call item needs "call_id", "name" and "arguments" (a JSON string)')
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{where}.call_id", "a function_call_output item needs the 'call_id' it answers")
            output = _content(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "item_reference":
            raise bad(where, "item references need stored items, which this server doesn't keep")
        else:
            raise bad(
                where, f"input item type {kind!r} is not supported (messages, function_call, function_call_output)"
            )
    return out


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "'tools' must be an array")
        fields["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise bad(f"tools[{i}]", "only function tools are supported")
            params = t.get("parameters") or {"type": "object", "properties": {}}
            function = {"name": t.get("name"), "description": t.get("description") or "", "parameters": params}
            fields["tools"].append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad(
                "tool_choice", '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", "name"}'
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        fields["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        fields["parallel_tool_calls"] = body["parallel_tool_calls"]
    return fields


def _format(body: dict[str, Any]) -> dict[str, Any] | None:
    text = body.get("text")
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad("text.format", "'text.format' must be an object")
    if fmt.get("type") == "json_schema":
        spec = {"name": fmt.get("name", "response"), "schema": fmt.get("schema"), "strict": fmt.get("strict", False)}
        return {"type": "json_schema", "json_schema": spec}
    return fmt  # text, json_object, or a type the chat parser refuses


def parse_response_request(body: dict[str, Any]) -> ChatRequest:
    """A /v1/responses body -> the typed request (stream flag included)."""
    for key, why in STATELESS.items():
        if body.get(key):
            raise bad(key, f"'{key}' is not supported: this server stores no responses; {why}")
    if body.get("reasoning") is not None:
        raise bad("reasoning", "'reasoning' is not supported by this model")
    if body.get("top_logprobs"):
        raise bad("top_logprobs", "'top_logprobs' is not supported on /v1/responses; use /v1/chat/completions")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "'instructions' must be a string")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + _input(body.get("input"))
    translated = {k: body[k] for k in ("model", "temperature", "top_p", "stream") if k in body}
    translated |= {"messages": messages, **_tools(body)}
    if body.get("max_output_tokens") is not None:
        translated["max_tokens"] = body["max_output_tokens"]
    if (fmt := _format(body)) is not None:
        translated["response_format"] = fmt
    return chat.parse_translated(translated, NAMES)


# -- events -> the response -------------------------------------------------------------------------------------
class ResponseBuilder:
    """The Responses API's stream, event by event, and the whole response it adds up to."""

    def __init__(self, body: dict[str, Any], model: str, prompt_tokens: int):
        self.prompt_tokens, self.seq, self.open = prompt_tokens, 0, False
        self.response: dict[str, Any] = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": model,
            "output": [],
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls", False),
            "previous_response_id": None,
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools", []),
            "text": body.get("text") or {"format": {"type": "text"}},
            "store": False,
            "truncation": "disabled",
            "metadata": body.get("metadata") or {},
            "usage": None,
        }

    def _event(self, kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        self.seq += 1
        return kind, {"type": kind, "sequence_number": self.seq - 1, **copy.deepcopy(fields)}

    @property
    def body(self) -> dict[str, Any]:
        return self.response

    def start(self) -> list[tuple[str, dict[str, Any]]]:
        return [
            self._event("response.created", response=self.response),
            self._event("response.in_progress", response=self.response),
        ]

    def _add(self, item: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self.response["output"].append(item)
        return self._event("response.output_item.added", output_index=len(self.response["output"]) - 1, item=item)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.response["output"][-1]["id"], "output_index": len(self.response["output"]) - 1}

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if not self.open:
            return []
        self.open = False
        item = self.response["output"][-1]
        item["status"] = "completed"
        part = item["content"][0]
        return [
            self._event("response.output_text.done", **self._where(), content_index=0, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", **self._where(), content_index=0, part=part),
            self._event("response.output_item.done", output_index=self._where()["output_index"], item=item),
        ]

    def feed(self, event: Event) -> list[tuple[str, dict[str, Any]]]:
        out = []
        if isinstance(event, TextOut):
            if not self.open:
                self.open = True
                message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress"}
                out.append(self._add(message | {"role": "assistant", "content": []}))
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
                self.response["output"][-1]["content"].append(part)
            self.response["output"][-1]["content"][0]["text"] += event.text
            delta = {"content_index": 0, "delta": event.text, "logprobs": []}
            return out + [self._event("response.output_text.delta", **self._where(), **delta)]
        out = self._close()
        if isinstance(event, CallOut):
            c = event.call
            item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": c.id, "name": c.name}
            out.append(self._add(item | {"arguments": "", "status": "in_progress"}))
            self.response["output"][-1] |= {"arguments": c.arguments, "status": "completed"}
            out.append(self._event("response.function_call_arguments.delta", **self._where(), delta=c.arguments))
            out.append(
                self._event(
                    "response.function_call_arguments.done", **self._where(), name=c.name, arguments=c.arguments
                )
            )
            done = self.response["output"][-1]
            return out + [
                self._event("response.output_item.done", output_index=self._where()["output_index"], item=done)
            ]
        incomplete = event.reason == "length"
        self.response |= {
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": event.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + event.completion_tokens,
            },
        }
        return out + [
            self._event("response.incomplete" if incomplete else "response.completed", response=self.response)
        ]

    def error(self, e: ApiError) -> bytes:
        kind, data = self._event("error", code=e.code, message=e.message, param=e.param)
        return chat.sse(data, kind)


async def create(api: ChatApi, request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    req = parse_response_request(body)
    api.check_model(req.options.model)
    async with api.chat_run(req, "responses") as run:
        builder = ResponseBuilder(body, req.options.model, run.prompt_tokens)
        return await chat.reply(request, run, builder, req.options.stream, builder.error)


def routes(api: ChatApi) -> list[web.RouteDef]:
    return [web.post("/v1/responses", functools.partial(create, api))]
