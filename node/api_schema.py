"""OpenAI request bodies: parsed and validated into typed requests, or an ApiError naming the bad field."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from shards.sampling import SamplingParams


class ApiError(Exception):
    """Becomes an OpenAI error object: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error",
                             503: "server_error", 500: "server_error"}.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, str]]
    max_tokens: int | None
    sampling: SamplingParams
    stream: bool


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


async def read_json(request: web.Request) -> dict[str, Any]:
    if request.content_type != "application/json":
        raise ApiError(400, f"Content-Type must be application/json, got {request.content_type!r}",
                       code="invalid_content_type")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body exceeds {request.app['max_body_bytes']} bytes", code="body_too_large") from None
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return body


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(key, f"'{key}' must be a number")
    if not lo <= value <= hi:
        raise bad(key, f"'{key}' must be between {lo:g} and {hi:g}, got {value}")
    return float(value)


def _int(body: dict, key: str, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(key, f"'{key}' must be an integer")
    if not lo <= value <= hi:
        raise bad(key, f"'{key}' must be between {lo} and {hi}, got {value}")
    return value


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": "..."}, ...]
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content[{j}]", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content", "content must be a string or a list of text parts")


def parse_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty array")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "each message must be an object")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad(f"messages[{i}].role", f"unsupported role {role!r}")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m, i)})
    return out


def parse_chat(body: dict) -> ChatRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "'model' must be a non-empty string")
    messages = parse_messages(body)
    max_tokens = _int(body, "max_completion_tokens", 1, 1 << 30)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, 1 << 30)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "'stream' must be a boolean")
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,  # top_p 0 means "only the most likely token"
    )
    return ChatRequest(model, messages, max_tokens, sampling, stream)
