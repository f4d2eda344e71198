"""OpenAI-compatible HTTP API on the entry node (aiohttp)."""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import asdict
from typing import Any

from aiohttp import web

from .api_schema import ApiError, ChatRequest, parse_chat, read_json
from .node import GenerationError, Node
from .plan import PlanError

log = logging.getLogger(__name__)
CREATED = int(time.time())


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure leaves as an OpenAI error object; tracebacks stay in the log."""
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(e.status)
        return ApiError(e.status, e.reason if e.status != 413 else f"request body exceeds {request.app['max_body_bytes']} bytes",
                        code=code).response()
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return ApiError(500, "internal server error").response()


class Api:
    def __init__(self, node: Node, max_tokens_cap: int):
        self.node = node
        self.max_tokens_cap = max_tokens_cap

    @property
    def model_id(self) -> str:
        return self.node.settings.model_id

    def app(self, max_body_bytes: int = 1 << 20) -> web.Application:
        app = web.Application(middlewares=[openai_errors], client_max_size=max_body_bytes)
        app["max_body_bytes"] = max_body_bytes
        app.add_routes([
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model_id:.+}", self.model),
            web.get("/v1/topology", self.topology),
            web.get("/healthcheck", self.healthcheck),
        ])
        return app

    # -- read-only endpoints ----------------------------------------------------------------------------------
    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": CREATED, "owned_by": "exo-node"}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model_id"] != self.model_id:
            raise ApiError(404, f"The model '{request.match_info['model_id']}' does not exist", param="model",
                           code="model_not_found")
        return web.json_response(self._model_card())

    async def healthcheck(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "node_id": self.node.id})

    async def topology(self, request: web.Request) -> web.Response:
        topo = self.node.topology()
        nodes = []
        for n in topo.nodes:
            d = asdict(n)
            d["loaded"] = [str(s) for s in n.loaded]
            nodes.append(d)
        return web.json_response({"nodes": nodes, "links": [asdict(link) for link in topo.links]})

    # -- chat completions -------------------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        chat = parse_chat(await read_json(request))
        if chat.model != self.model_id:
            raise ApiError(404, f"The model '{chat.model}' does not exist; this cluster serves '{self.model_id}'",
                           param="model", code="model_not_found")
        try:
            prompt = self.node.tokenizer.encode_chat(chat.messages)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        max_tokens = self._max_tokens(chat, len(prompt))
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_id}
        events = self.node.generate(prompt, chat.sampling, max_tokens)  # plan errors surface on first iteration
        if chat.stream:
            return await self._stream(request, events, meta)
        return await self._complete(events, meta, len(prompt))

    def _max_tokens(self, chat: ChatRequest, prompt_len: int) -> int:
        room = self.node.config.max_position_embeddings - prompt_len
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                                f"{self.node.config.max_position_embeddings}", param="messages",
                           code="context_length_exceeded")
        if chat.max_tokens is None:
            return min(self.max_tokens_cap, room)
        if chat.max_tokens > room:
            raise ApiError(400, f"prompt ({prompt_len} tokens) + max_tokens ({chat.max_tokens}) exceeds the context "
                                f"length {self.node.config.max_position_embeddings}", param="max_tokens",
                           code="context_length_exceeded")
        return chat.max_tokens

    async def _complete(self, events, meta: dict, prompt_len: int) -> web.Response:
        stream = self.node.tokenizer.stream()
        text, n, reason = [], 0, None
        try:
            async for ev in events:
                for r in ev.results:
                    n += 1
                    text.append(stream.push(r.token))
                reason = ev.finish_reason
        except PlanError as e:
            raise ApiError(503, f"the cluster cannot serve this model now: {e}") from None
        except GenerationError as e:
            raise ApiError(503, f"generation failed: {e}", code="generation_failed") from None
        text.append(stream.flush())
        return web.json_response({
            **meta,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                         "logprobs": None, "finish_reason": reason}],
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n},
        })

    async def _stream(self, request: web.Request, events, meta: dict) -> web.StreamResponse:
        first = await _first_event(events)  # fail before the 200 is sent when the ring can't start
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        def chunk(delta: dict, reason: str | None = None) -> dict:
            return {**meta, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

        stream = self.node.tokenizer.stream()
        await send(chunk({"role": "assistant", "content": ""}))
        reason = None
        try:
            async for ev in _chain(first, events):
                piece = "".join(stream.push(r.token) for r in ev.results)
                if ev.finished:
                    piece += stream.flush()
                    reason = ev.finish_reason
                if piece:
                    await send(chunk({"content": piece}))
            await send(chunk({}, reason))
        except GenerationError as e:
            await send(ApiError(503, f"generation failed: {e}", code="generation_failed").body())
        await send("[DONE]")
        await response.write_eof()
        return response


async def _first_event(events):
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None
    except PlanError as e:
        raise ApiError(503, f"the cluster cannot serve this model now: {e}") from None
    except GenerationError as e:
        raise ApiError(503, f"generation failed: {e}", code="generation_failed") from None


async def _chain(first, events):
    if first is None:
        return
    yield first
    if not first.finished:
        async for ev in events:
            yield ev
