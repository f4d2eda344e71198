"""OpenAI-compatible HTTP API on the entry node (aiohttp).

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming with server-sent events or not),
GET /v1/models, GET /v1/models/{id}, GET /v1/topology, GET /healthcheck; GET /metrics (Prometheus text format,
node/runtime/metrics.py); the web page at GET / (node/http/webui.py). CORS, error bodies and the API key are the
middlewares of node/http/middleware.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from node.core.plan import PlanError
from node.http import anthropic, chat, middleware, ollama, responses, webui
from node.http.chat import ChatRun
from node.http.completion import Job, run_job
from node.http.format import ChatFormat, CompletionFormat, Format
from node.http.pieces import Pieces
from node.http.prompt import PromptEncoder
from node.http.schema import ApiError, ChatRequest, CompletionRequest, Options, parse_chat, parse_completion, read_json
from node.http.tools import ToolError, prompt_inputs, with_tool_syntax
from node.runtime.node import Node
from shards.decoding.grammar import Constraint, GrammarError, grammar_tokenizer
from shards.decoding.grammar_admission import admit

log = logging.getLogger(__name__)
CREATED = int(time.time())
# Each dialect's paths answer every error in that API's own shape; the others, OpenAI error objects.
ERROR_SHAPES = ((ollama.PATHS, ollama.error_response), (anthropic.PATHS, anthropic.error_response))


@dataclass(frozen=True)
class ApiSettings:
    max_tokens_cap: int = 1024  # default and ceiling for max_tokens
    max_body_bytes: int = 1 << 20
    max_concurrent: int = 64  # requests generating at once; beyond -> 503
    api_key: str | None = None  # when set, requests need "Authorization: Bearer <key>"
    cors_origins: tuple[str, ...] = ()  # empty: no CORS headers
    parse_special_in_content: bool = False  # control-token text in message content read as control tokens


class Api:
    def __init__(self, node: Node, settings: ApiSettings = ApiSettings()):
        self.node, self.settings = node, settings
        self.active = 0
        self.prompts = PromptEncoder(
            node.tokenizer, node.config.max_position_embeddings, settings.parse_special_in_content
        )

    @property
    def model_id(self) -> str:
        return self.node.model_id

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[
                middleware.cors(self.settings.cors_origins),
                webui.security_headers,
                middleware.errors(self.settings.max_body_bytes, ERROR_SHAPES),
                middleware.auth(self.settings.api_key),
            ],
            client_max_size=self.settings.max_body_bytes,
        )
        app.add_routes(
            [
                web.post("/v1/chat/completions", self.chat_completions),
                web.post("/v1/completions", self.completions),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model_id:.+}", self.model),
                web.get("/v1/topology", self.topology),
                web.get("/healthcheck", self.healthcheck),
                web.get("/metrics", self.metrics),
                *ollama.routes(self),
                *anthropic.routes(self),
                *responses.routes(self),
                *webui.routes(),
            ]
        )
        return app

    # -- read-only endpoints ----------------------------------------------------------------------------------
    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": CREATED, "owned_by": "exo-node"}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        self.check_model(request.match_info["model_id"])
        return web.json_response(self._model_card())

    async def healthcheck(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "node_id": self.node.id})

    async def topology(self, request: web.Request) -> web.Response:
        topo = self.node.topology()
        nodes = [asdict(n) | {"loaded": [str(s) for s in n.loaded]} for n in topo.nodes]
        try:  # the layers each node would run for a request arriving now (what the web page draws)
            plan, plan_error = (
                [
                    {"node_id": step.node_id, "start": step.shard.start_layer, "end": step.shard.end_layer}
                    for step in self.node.make_plan()
                ],
                None,
            )
        except PlanError as e:
            plan, plan_error = None, str(e)
        return web.json_response(
            {
                "nodes": nodes,
                "links": [asdict(link) for link in topo.links],
                "model": {"id": self.model_id, "n_layers": self.node.config.n_layers},
                "plan": plan,
                "plan_error": plan_error,
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        # The classic text format unless the scraper asks for OpenMetrics.
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(self.node.metrics.registry), headers={"Content-Type": content_type})

    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise ApiError(
                404,
                f"The model '{model}' does not exist; this cluster serves '{self.model_id}'",
                param="model",
                code="model_not_found",
            )

    # -- generation endpoints ---------------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_chat(await read_json(request))
        self.check_model(req.options.model)
        async with self.chat_run(req) as run:
            options = dataclasses.replace(req.options, structure=run.structure)  # in the model's tool syntax
            fmt = ChatFormat(options, run.prompt_tokens, self.model_id)
            return await self._respond(request, fmt, run.pieces, "")

    @asynccontextmanager
    async def chat_run(self, req: ChatRequest, endpoint: str = "chat") -> AsyncIterator[ChatRun]:
        """The one chat path of every API dialect (node/http/chat.py): the conversation rendered by the chat
        template (tools too), its grammar compiled, the request admitted and its first piece generated. Refusals
        before that are ApiErrors (each dialect's error middleware shapes them); leaving the block ends the
        request on every node of its plan."""
        req = with_tool_syntax(req, self.node.tokenizer)  # calls in the model family's own syntax
        messages, tools = prompt_inputs(req.messages, req.options.structure, self.node.tokenizer.chat_template)
        prompt = await self.prompts.chat(messages, tools)
        req = await self._constrained(req)
        async with self._running(endpoint, req.options, prompt, "messages") as pieces:
            yield ChatRun(len(prompt), req.options.structure, pieces)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_completion(await read_json(request))
        self.check_model(req.options.model)
        tok = self.node.tokenizer
        if isinstance(req.prompt, str):
            prompt, echo = await self.prompts.text(req.prompt), req.prompt
        else:
            if max(req.prompt) >= self.node.config.vocab_size:
                raise ApiError(
                    400,
                    f"token ids must be below the vocabulary size {self.node.config.vocab_size}",
                    param="prompt",
                    code="invalid_value",
                )
            prompt, echo = list(req.prompt), tok.decode(req.prompt)
        req = await self._constrained(req)
        async with self._running("completions", req.options, prompt, "prompt") as pieces:
            fmt = CompletionFormat(req.options, len(prompt), self.model_id)
            return await self._respond(request, fmt, pieces, echo if req.echo else "")

    async def _constrained(self, req: ChatRequest | CompletionRequest) -> ChatRequest | CompletionRequest:
        """The request with the grammar its tools or response_format ask for, compiled and checked against the
        model's vocabulary here, before any node works (a 400 naming the problem); off the event loop."""
        opts = req.options
        try:
            grammar = await asyncio.to_thread(opts.structure.grammar)
            if grammar is None:
                return req
            checker = await asyncio.to_thread(grammar_tokenizer, self.node.tokenizer)
            schemas = [t.parameters for t in opts.structure.tools] + [opts.structure.json_schema]
            await asyncio.to_thread(admit, checker, grammar, schemas)  # first steps, patterns, finite $refs
            constraint = Constraint(grammar)
        except (ToolError, GrammarError) as e:
            raise ApiError(
                400, f"{opts.structure.param}: {e}", param=opts.structure.param, code="invalid_schema"
            ) from None
        sampling = dataclasses.replace(opts.sampling, constraint=constraint)
        return dataclasses.replace(req, options=dataclasses.replace(opts, sampling=sampling))

    def _job(self, opts: Options, prompt: list[int], param: str) -> Job:
        context = self.node.config.max_position_embeddings
        room = context - len(prompt)
        if room < 1:
            raise ApiError(
                400,
                f"the prompt has {len(prompt)} tokens; this model's context is {context}",
                param=param,
                code="context_length_exceeded",
            )
        vocab = self.node.config.vocab_size
        if opts.sampling.logit_bias and opts.sampling.logit_bias[-1][0] >= vocab:
            raise ApiError(
                400,
                f"logit_bias names token {opts.sampling.logit_bias[-1][0]}; this model's token ids are below {vocab}",
                param="logit_bias",
                code="invalid_value",
            )
        max_tokens = min(self.settings.max_tokens_cap, room) if opts.max_tokens is None else opts.max_tokens
        if max_tokens > room:
            raise ApiError(
                400,
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the context length {context}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if max_tokens > self.settings.max_tokens_cap:
            raise ApiError(
                400,
                f"max_tokens may be at most {self.settings.max_tokens_cap} on this node",
                param="max_tokens",
                code="invalid_value",
            )
        return Job(prompt, self.node.model.sampling.fill(opts.sampling, opts.given), max_tokens, opts.stop)

    @asynccontextmanager
    async def _running(self, endpoint: str, opts: Options, prompt: list[int], param: str) -> AsyncIterator[Pieces]:
        """The request admitted (or refused: beyond the context, draining, at the concurrency limit) and its text
        pieces, the first already awaited so that errors before any token are plain HTTP errors."""
        with self.node.metrics.request(endpoint, refusals=(ApiError,)) as observed:
            job = self._job(opts, prompt, param)
            if self.node.draining:
                raise ApiError(
                    503, "this node is shutting down; send the request to another node", code="shutting_down"
                )
            if self.active >= self.settings.max_concurrent:
                raise ApiError(
                    503,
                    f"the node is at its limit of {self.settings.max_concurrent} concurrent requests; retry shortly",
                    code="server_overloaded",
                    retry_after=1,
                )
            observed.admitted(len(prompt))
            self.active += 1
            pieces = Pieces(run_job(self.node, job, observed.tokens), observed)
            try:
                yield await pieces.peek()
            finally:
                self.active -= 1
                await pieces.aclose()

    async def _respond(self, request: web.Request, fmt: Format, pieces, echo: str) -> web.StreamResponse:
        if fmt.options.stream:
            return await self._stream(request, fmt, pieces, echo)
        return web.json_response(fmt.whole([piece async for piece in pieces], echo))

    async def _stream(self, request: web.Request, fmt: Format, pieces, echo: str):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(payload: dict[str, Any] | str) -> None:
            await chat.write(
                request, response, f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()
            )

        await send(fmt.opening(echo))
        last = None
        try:
            async for piece in pieces:
                for chunk in fmt.piece_chunks(piece):
                    await send(chunk)
                last = piece
            if fmt.options.include_usage and last is not None:
                await send(fmt.usage_chunk(last.completion_tokens))
        except ApiError as e:  # the stream has started: the error goes in-band, then the stream ends
            await send(e.body())
        except (ConnectionError, asyncio.CancelledError):
            raise  # the client is gone: nothing can reach it
        except Exception:  # a bug after the first chunk: still an error event and [DONE], never a stream cut short
            log.exception("stream of %s %s failed", request.method, request.path)
            await send(ApiError(500, "internal server error").body())
        await send("[DONE]")
        await response.write_eof()
        return response
