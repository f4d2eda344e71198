"""The Ollama API on the same port: /api/chat, /api/generate (NDJSON streams by default, as Ollama), /api/tags,
/api/show, /api/ps, /api/version.

A body is translated into the OpenAI chat body and parsed by the same code (node/http/chat.py), so it is
generated, constrained and refused exactly as /v1/chat/completions is; errors are Ollama's `{"error": "..."}`
with a 4xx. Ollama's options map onto sampling, and an option a request leaves out takes Ollama's own default
(`DEFAULTS`), not the OpenAI API's: a client that names none samples as it would from Ollama. Options about
Ollama's own runtime (num_ctx, num_gpu, keep_alive, ...) have no meaning here and are ignored, as Ollama ignores
unknown ones; sampling we cannot do (mirostat, typical_p, tfs_z) is refused.
"""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from node.http import chat
from node.http.chat import CallOut, ChatApi, Event, Finished, TextOut
from node.http.schema import ApiError, ChatRequest, bad, read_json
from shards.decoding.penalties import MAX_PENALTY_WINDOW

PATHS = ("/api/",)
VERSION = "0.6.3"  # the Ollama release whose API this follows (clients check it for features)
STARTED = datetime.now(UTC).isoformat()
# options with a sampling meaning here: Ollama's name -> the OpenAI field
SAMPLING = {
    k: k
    for k in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "repeat_penalty",
        "repeat_last_n",
        "presence_penalty",
        "frequency_penalty",
    )
}
# What Ollama samples with where a request leaves an option out (its api.DefaultOptions): a client that names no
# option (Open WebUI, `ollama.chat(...)`) expects these, not the OpenAI API's temperature 1 over the whole
# vocabulary. Not its repeat_penalty 1.1: Ollama's own engine, which runs current models, never applies it
# (ollama/ollama#15783), and over a prompt's tail it works against what a tool call must repeat (the tool loop of
# tests/cluster/test_clients.py found no call in 8 seeds with it). A model's own recommended sampling comes on top
# (its GGUF's general.sampling.* keys: shards/formats/sampling_defaults.py), as a Modelfile's parameters do there.
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
RANDOM_SEED = -1  # Ollama's `seed` -1 (its default): no seed, a new draw each request
WHOLE_CONTEXT = -1  # Ollama's `repeat_last_n` -1: the whole context; here the longest window there is
NEUTRAL = {  # options we cannot honour, allowed only at the value that changes nothing
    "mirostat": 0,
    "typical_p": 1.0,
    "tfs_z": 1.0,
}
NAMES = {"max_tokens": "options.num_predict", "response_format": "format"} | {
    v: f"options.{k}" for k, v in SAMPLING.items()
}


def error_response(e: ApiError) -> web.Response:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return web.json_response({"error": e.message}, status=e.status, headers=headers)


def _error_line(e: ApiError) -> bytes:
    return json.dumps({"error": e.message}).encode() + b"\n"  # a stream's last line, as Ollama ends one


# -- requests -> ChatRequest ------------------------------------------------------------------------------------
def _is_int(value: Any, n: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value == n


def _options(body: dict[str, Any]) -> tuple[dict[str, Any], frozenset[str]]:
    """The OpenAI fields that `options` (and `format`, `think`, `logprobs`) say, and which of them are Ollama's
    defaults standing for options the client left out."""
    options = {} if body.get("options") is None else body["options"]
    if not isinstance(options, dict):
        raise bad("options", "'options' must be an object")
    for key, neutral in NEUTRAL.items():
        if options.get(key) not in (None, neutral):
            raise bad(f"options.{key}", f"'options.{key}' is not supported (only {neutral})")
    given = {SAMPLING[k]: v for k, v in options.items() if k in SAMPLING and v is not None}
    if _is_int(given.get("seed"), RANDOM_SEED):
        del given["seed"]
    if _is_int(given.get("repeat_last_n"), WHOLE_CONTEXT):
        given["repeat_last_n"] = MAX_PENALTY_WINDOW
    out, defaulted = DEFAULTS | given, frozenset(DEFAULTS) - given.keys()
    n = options.get("num_predict")
    if n is not None and n not in (-1, -2):  # -1 / -2: as long as the node allows
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise bad("options.num_predict", "'options.num_predict' must be a positive integer, -1 or -2")
        out["max_tokens"] = n
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise bad("format", "'format' must be \"json\" or a JSON schema object")
    if body.get("think") not in (None, False):
        raise bad("think", f"'{body.get('model')}' does not support thinking")
    if body.get("logprobs") not in (None, False):
        raise bad("logprobs", "'logprobs' is not supported on the Ollama API; use /v1/chat/completions")
    return out, defaulted


def _messages(messages: Any) -> list[dict[str, Any]]:
    """Ollama messages as OpenAI's: calls get ids, and each tool message the id of the call it answers (the call
    of its `tool_name`, else the next one unanswered)."""
    if not isinstance(messages, list):
        raise bad("messages", "'messages' must be an array")
    out, pending = [], []  # pending: (id, name) of calls not yet answered
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "each message must be an object")
        if m.get("images"):
            raise bad(f"messages[{i}].images", "images are not supported: this model reads text only")
        message = {"role": m.get("role"), "content": m.get("content") or ""}
        calls = m.get("tool_calls")
        if calls and m.get("role") == "assistant":
            if not isinstance(calls, list):
                raise bad(f"messages[{i}].tool_calls", "'tool_calls' must be an array")
            message["tool_calls"], pending = [], []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad(f"messages[{i}].tool_calls[{j}]", 'a tool call needs "function": {"name", "arguments"}')
                args = fn.get("arguments") or {}
                if not isinstance(args, dict):
                    raise bad(f"messages[{i}].tool_calls[{j}].function.arguments", "arguments must be an object")
                pending.append((f"call_{i}_{j}", fn["name"]))
                message["tool_calls"].append(
                    {
                        "id": pending[-1][0],
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": json.dumps(args)},
                    }
                )
        if m.get("role") == "tool":
            name = m.get("tool_name")
            match = next((p for p in pending if p[1] == name), pending[0] if pending else None)
            if match is None:
                raise bad(
                    f"messages[{i}]", "a tool message must follow an assistant message whose tool call it answers"
                )
            pending.remove(match)
            message["tool_call_id"] = match[0]
        out.append(message)
    return out


def parse_chat(body: dict[str, Any]) -> tuple[ChatRequest, bool]:
    """An /api/chat body -> the typed request and whether to stream (Ollama's default: yes)."""
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise bad("stream", "'stream' must be a boolean")
    options, defaulted = _options(body)
    translated = {"model": body.get("model"), "messages": _messages(body.get("messages")), **options}
    if body.get("tools") is not None:
        translated["tools"] = body["tools"]
    req = chat.parse_translated(translated, NAMES)
    # Ollama's defaults stand where the client named nothing, under the model's own (as a Modelfile's override them)
    return dataclasses.replace(
        req, options=dataclasses.replace(req.options, given=req.options.given - defaulted)
    ), stream


def parse_generate(body: dict[str, Any]) -> tuple[ChatRequest, bool]:
    """An /api/generate body: its `prompt` (and `system`) as a chat through the model's template."""
    for key in ("suffix", "template", "context", "images"):
        if body.get(key):
            raise bad(key, f"'{key}' is not supported on /api/generate")
    if body.get("raw"):
        raise bad("raw", "'raw' is not supported; send the text to /v1/completions")
    prompt, system = body.get("prompt"), body.get("system")
    if not isinstance(prompt, str) or not prompt:
        raise bad("prompt", "'prompt' must be a non-empty string")
    if system is not None and not isinstance(system, str):
        raise bad("system", "'system' must be a string")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return parse_chat(
        {k: v for k, v in body.items() if k not in ("prompt", "system", "tools")} | {"messages": messages}
    )


# -- events -> responses ----------------------------------------------------------------------------------------
def _line(model: str, done: bool, **fields: Any) -> dict[str, Any]:
    return {"model": model, "created_at": datetime.now(UTC).isoformat(), **fields, "done": done}


def chunk(model: str, event: Event, generate: bool, prompt_tokens: int, started: float) -> dict[str, Any]:
    """One NDJSON line of the stream for one event (a whole answer is these lines folded: `fold`)."""
    if isinstance(event, Finished):
        final = {
            "done_reason": "length" if event.reason == "length" else "stop",
            "total_duration": int((time.perf_counter() - started) * 1e9),
            "prompt_eval_count": prompt_tokens,
            "eval_count": event.completion_tokens,
        }
        return _line(model, True, **({"response": ""} if generate else {"message": _message("")}), **final)
    if generate:
        return _line(model, False, response=event.text if isinstance(event, TextOut) else "")
    if isinstance(event, CallOut):
        call = {"function": {"index": event.call.index, "name": event.call.name, "arguments": event.arguments}}
        return _line(model, False, message=_message("", [call]))
    return _line(model, False, message=_message(event.text))


def _message(content: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})


def fold(lines: list[dict[str, Any]], generate: bool) -> dict[str, Any]:
    whole = dict(lines[-1])
    if generate:
        whole["response"] = "".join(line["response"] for line in lines)
    else:
        calls = [c for line in lines for c in line["message"].get("tool_calls", ())]
        whole["message"] = _message("".join(line["message"]["content"] for line in lines), calls)
    return whole


# -- the endpoints ----------------------------------------------------------------------------------------------
class Ollama:
    def __init__(self, api: ChatApi):
        self.api = api

    def _check_model(self, model: Any) -> None:
        if not isinstance(model, str) or not model:
            raise bad("model", "'model' must be a non-empty string")
        if model.removesuffix(":latest") != self.api.model_id:
            raise ApiError(404, f"model '{model}' not found; this cluster serves '{self.api.model_id}'")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, generate=False)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, generate=True)

    async def _answer(self, request: web.Request, generate: bool) -> web.StreamResponse:
        body = await read_json(request, any_content_type=True)
        model = body.get("model")
        self._check_model(model)
        if body.get("prompt" if generate else "messages") in (None, "", []):  # Ollama: nothing to say loads the model
            empty = {"response": ""} if generate else {"message": _message("")}
            return web.json_response(_line(model, True, **empty, done_reason="load"))
        req, stream = (parse_generate if generate else parse_chat)(body)
        req = dataclasses.replace(req, options=dataclasses.replace(req.options, model=self.api.model_id))
        started = time.perf_counter()
        async with self.api.chat_run(req, "ollama") as run:
            lines = (chunk(model, e, generate, run.prompt_tokens, started) async for e in run.events())
            if not stream:
                return web.json_response(fold([line async for line in lines], generate))
            ndjson = (json.dumps(line, ensure_ascii=False).encode() + b"\n" async for line in lines)
            return await chat.stream(request, "application/x-ndjson", ndjson, _error_line)

    def _model(self) -> dict[str, Any]:
        cfg = self.api.node.config
        fmt = "gguf" if self.api.node.model.path.suffix == ".gguf" else "safetensors"
        details = {"format": fmt, "family": cfg.model_type, "families": [cfg.model_type], "parent_model": ""}
        return {"name": self.api.model_id, "model": self.api.model_id, "modified_at": STARTED, "details": details}

    async def tags(self, request: web.Request) -> web.Response:
        return web.json_response({"models": [self._model()]})

    async def ps(self, request: web.Request) -> web.Response:
        return web.json_response({"models": [self._model() | {"expires_at": "9999-12-31T23:59:59Z"}]})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def show(self, request: web.Request) -> web.Response:
        body = await read_json(request, any_content_type=True)
        model = body.get("model", body.get("name"))
        self._check_model(model)
        cfg, tokenizer = self.api.node.config, self.api.node.tokenizer
        info = {
            "general.architecture": cfg.model_type,
            f"{cfg.model_type}.block_count": cfg.n_layers,
            f"{cfg.model_type}.context_length": cfg.max_position_embeddings,
            f"{cfg.model_type}.embedding_length": cfg.hidden_size,
            f"{cfg.model_type}.attention.head_count": cfg.n_heads,
            f"{cfg.model_type}.attention.head_count_kv": cfg.n_kv_heads,
        }
        return web.json_response(
            {
                "modelfile": "",
                "parameters": "",
                "template": tokenizer.chat_template or "",
                "details": self._model()["details"],
                "model_info": info,
                "capabilities": ["completion", "tools"],
                "modified_at": STARTED,
            }
        )


def routes(api: ChatApi) -> list[web.RouteDef]:
    o = Ollama(api)
    return [
        web.post("/api/chat", o.chat),
        web.post("/api/generate", o.generate),
        web.get("/api/tags", o.tags),
        web.post("/api/show", o.show),
        web.get("/api/ps", o.ps),
        web.get("/api/version", o.version),
    ]
