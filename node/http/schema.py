"""OpenAI request bodies: parsed and validated into typed requests, or an ApiError naming the bad field.

Unknown fields are ignored, as OpenAI does. Known fields we cannot honour (n > 1, suffix, best_of > 1) are refused
with a 400 rather than silently ignored. Besides OpenAI's sampling fields (presence_penalty, frequency_penalty,
logit_bias included), llama-server's and vLLM's extensions are read: top_k, min_p, repeat_penalty (or
repetition_penalty) and repeat_last_n. Tools and response formats: node/http/tools.py.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from node.http.tools import Structure, ToolError, check_tool_messages, parse_structure, parse_tool_calls
from shards.decoding.penalties import DEFAULT_WINDOW, MAX_BIAS, MAX_LOGIT_BIAS, MAX_PENALTY_WINDOW
from shards.decoding.sampling import MAX_TOP_LOGPROBS, SamplingParams

BODY_TIMEOUT_S = 30
OFF_LOOP_BYTES = 64 * 1024  # bodies past this are parsed on a worker thread (the loop runs between their parses)
MAX_STOPS = 4
MAX_STOP_CHARS = 256
COMPLETIONS_MAX_LOGPROBS = 5


class ApiError(Exception):
    """Becomes an OpenAI error object: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after  # seconds, for a Retry-After header (503 when busy)
        self.type = self.TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        headers = (headers or {}) | ({"Retry-After": str(self.retry_after)} if self.retry_after else {})
        return web.json_response(self.body(), status=self.status, headers=headers)


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


@dataclass(frozen=True)
class Options:
    """What both endpoints share."""

    model: str
    max_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    structure: Structure = Structure()  # tools / response_format
    # the sampling fields the request named (SamplingParams names): the model's own defaults fill the others
    # (shards/formats/sampling_defaults.py, at node/http/api.py)
    given: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ChatRequest:
    options: Options
    messages: list[dict[str, Any]]  # role, content; assistant tool_calls; tool messages' tool_call_id


@dataclass(frozen=True)
class CompletionRequest:
    options: Options
    prompt: str | list[int]
    echo: bool


async def read_json(request: web.Request, any_content_type: bool = False) -> dict[str, Any]:
    """`any_content_type`: read the body as JSON whatever its Content-Type says (Ollama's API, whose clients
    often send none)."""
    if not any_content_type and request.content_type != "application/json":
        raise ApiError(
            400, f"Content-Type must be application/json, got {request.content_type!r}", code="invalid_content_type"
        )
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):  # a client trickling its body can't hold a handler forever
            raw = await request.read()  # too large: aiohttp raises 413, which the error middleware words
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S}s", code="timeout") from None
    body = await asyncio.to_thread(_parse, raw) if len(raw) > OFF_LOOP_BYTES else _parse(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return body


def _parse(raw: bytes) -> Any:
    """The JSON value of `raw`, or an ApiError 400 saying what is wrong with it."""
    try:
        body = json.loads(raw)
        # JSON may spell lone UTF-16 surrogates ("\ud800"): valid JSON, but not text any tokenizer can take. Only
        # an escape can spell one (UTF-8 can't), so only a body with "\ud" escapes, or in UTF-16/32 (which json
        # also reads: a NUL in the first 4 bytes), pays for the round trip.
        if b"\\ud" in raw.lower() or b"\x00" in raw[:4]:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            400, "request body holds a lone surrogate (\\ud800-\\udfff): not valid Unicode text", code="invalid_json"
        ) from None
    # ValueError covers JSONDecodeError and integers too long to convert (Python refuses > 4300 digits).
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    return body


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(key, f"'{key}' must be a number")
    try:
        number = float(value)  # an int beyond float's range overflows: not a usable number either
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or not lo <= number <= hi:
        raise bad(key, f"'{key}' must be a number between {lo:g} and {hi:g}")
    return number


def _int(body: dict, key: str, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(key, f"'{key}' must be an integer")
    if not lo <= value <= hi:
        raise bad(key, f"'{key}' must be between {lo} and {hi}")
    return value


def _bool(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(key, f"'{key}' must be a boolean")
    return value


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", "'stop' must be a string or an array of strings")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"'stop' may hold at most {MAX_STOPS} sequences")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad("stop", f"stop sequences must be 1 to {MAX_STOP_CHARS} characters")
    return tuple(dict.fromkeys(stops))


def _unsupported(body: dict) -> None:
    n = _int(body, "n", 1, 128)
    if n not in (None, 1):
        raise bad("n", "only n=1 is supported")


def _penalties(body: dict) -> dict[str, Any]:
    """The bias and penalty fields, as SamplingParams takes them (shards/decoding/penalties.py)."""
    if body.get("repeat_penalty") is not None and body.get("repetition_penalty") is not None:
        raise bad("repetition_penalty", "give 'repeat_penalty' or 'repetition_penalty', not both")
    repeat = "repetition_penalty" if body.get("repetition_penalty") is not None else "repeat_penalty"
    window = _int(body, "repeat_last_n", 0, MAX_PENALTY_WINDOW)
    return {
        "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": _number(body, repeat, 1.0, 1e-6, 10.0),
        "penalty_last_n": DEFAULT_WINDOW if window is None else window,
        "logit_bias": _logit_bias(body.get("logit_bias")),
        "min_p": _number(body, "min_p", 0.0, 0.0, 1.0),
    }


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} map, as (id, bias) pairs by id; whether the ids are in the model's vocabulary
    is checked where the vocabulary is known (node/http/api.py)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad("logit_bias", "'logit_bias' must be an object mapping token ids to numbers")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9):
            raise bad("logit_bias", f"'logit_bias' keys must be token ids (decimal strings), got {key!r}")
        try:
            ok = not isinstance(bias, bool) and isinstance(bias, (int, float)) and -MAX_BIAS <= float(bias) <= MAX_BIAS
        except OverflowError:
            ok = False
        if not ok:
            raise bad("logit_bias", f"logit_bias[{key!r}] must be a number between -{MAX_BIAS:g} and {MAX_BIAS:g}")
        out[int(key)] = float(bias)
    return tuple(sorted(out.items()))


# a SamplingParams field a model may recommend -> the body's names for it
GIVEN = {
    "temperature": ("temperature",),
    "top_k": ("top_k",),
    "top_p": ("top_p",),
    "min_p": ("min_p",),
    "repetition_penalty": ("repeat_penalty", "repetition_penalty"),
    "penalty_last_n": ("repeat_last_n",),
}


def _options(body: dict, top_logprobs: int | None, default_max_tokens: int | None, chat: bool) -> Options:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "'model' must be a non-empty string")
    _unsupported(body)
    try:
        structure = parse_structure(body, chat)
    except ToolError as e:
        raise bad(e.param, str(e)) from None
    max_tokens = _int(body, "max_completion_tokens", 1, 1 << 30)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, 1 << 30)
    stream = _bool(body, "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad("stream_options", "'stream_options' must be an object")
    include_usage = _bool(stream_options or {}, "include_usage")
    if stream_options is not None and not stream:
        raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    seed = _int(body, "seed", -(1 << 63), (1 << 64) - 1)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    sampling = SamplingParams(
        temperature=temperature,
        top_p=top_p if top_p > 0 else 1e-9,  # top_p 0 means "only the most likely token"
        top_k=_int(body, "top_k", 0, (1 << 31) - 1) or 0,  # an int32 on the wire
        seed=None if seed is None else seed % (1 << 64),  # OpenAI accepts any integer seed
        top_logprobs=top_logprobs,
        speculate=_bool(body, "speculative", True),  # an extension: false opts out of speculative decoding
        **_penalties(body),
    )
    return Options(
        model,
        max_tokens if max_tokens is not None else default_max_tokens,
        sampling,
        _stops(body),
        stream,
        include_usage,
        structure,
        frozenset(field for field, names in GIVEN.items() if any(body.get(n) is not None for n in names)),
    )


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None and message.get("role") == "assistant":  # e.g. a message holding only tool calls
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


def parse_chat(body: dict) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty array")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "each message must be an object")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"messages[{i}].role", f"unsupported role {role!r}")
        message: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _content(m, i)}
        try:
            if role == "assistant" and m.get("tool_calls") is not None:
                message["tool_calls"] = parse_tool_calls(m["tool_calls"], i)
        except ToolError as e:
            raise bad(e.param, str(e)) from None
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise bad(f"messages[{i}].tool_call_id", "a tool message needs the 'tool_call_id' it answers")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    try:
        check_tool_messages(out)
    except ToolError as e:
        raise bad(e.param, str(e)) from None
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise bad("top_logprobs", "'top_logprobs' requires 'logprobs': true")
    return ChatRequest(_options(body, (top or 0) if logprobs else None, None, True), out)


def parse_completion(body: dict) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise bad("prompt", "'prompt' must be a string, or one array of token ids (batches are not supported)")
    elif not isinstance(prompt, str) or not prompt:
        raise bad("prompt", "'prompt' must be a non-empty string")
    if body.get("suffix"):
        raise bad("suffix", "'suffix' is not supported")
    if _int(body, "best_of", 1, 1) not in (None, 1):
        raise bad("best_of", "only best_of=1 is supported")
    logprobs = _int(body, "logprobs", 0, COMPLETIONS_MAX_LOGPROBS)
    return CompletionRequest(_options(body, logprobs, 16, False), prompt, _bool(body, "echo"))
