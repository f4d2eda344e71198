"""The aiohttp middlewares around every API route: CORS, OpenAI-shaped error bodies, the API key.

Each is built from the one setting it reads, so this module knows nothing of the endpoints or of ApiSettings. Order
matters and is the caller's (node/http/api.py): CORS outermost, so even a 401 or an error body carries the CORS
headers a browser needs to read it; errors outside auth, so a refused key leaves as an OpenAI error object too.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable

from aiohttp import web

from node.http import webui
from node.http.schema import ApiError
from node.runtime.entry import CLIENT_KEY

log = logging.getLogger(__name__)


Shape = Callable[[ApiError], web.Response]


def errors(max_body_bytes: int, shapes: tuple[tuple[tuple[str, ...], Shape], ...] = ()):
    """Every failure leaves as an error object (tracebacks stay in the log): in the shape of the API whose path
    prefixes (`shapes`: (prefixes, shape) pairs; Ollama, Anthropic) the request went to, else OpenAI's.
    `max_body_bytes` is aiohttp's client_max_size, named in the 413 so the client knows the limit it ran into."""

    def respond(request: web.Request, e: ApiError) -> web.Response:
        shape = next((shape for prefixes, shape in shapes if request.path.startswith(prefixes)), None)
        return e.response() if shape is None else shape(e)

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return respond(request, e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            message = (
                f"request body exceeds {max_body_bytes} bytes"
                if e.status == 413
                else f"{e.reason}: {request.method} {request.path}"
            )
            code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(e.status)
            return respond(request, ApiError(e.status, message, code=code))
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            return respond(request, ApiError(500, "internal server error"))

    return middleware


def auth(api_key: str | None):
    """With a key, every non-public path (webui.is_public) needs "Authorization: Bearer <key>" or, as Anthropic
    clients send it, "x-api-key: <key>", compared in constant time; without one, everything is open."""

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        bearer = request.headers.get("Authorization", "").encode()
        x_api_key = request.headers.get("x-api-key", "").encode()
        CLIENT_KEY.set(client_key(bearer, x_api_key))  # this request's task: the entry scopes prefixes by it
        if api_key and not webui.is_public(request.path):
            # both compared, always: how long a refusal takes doesn't tell which header came close
            ok = hmac.compare_digest(bearer, f"Bearer {api_key}".encode())
            ok |= hmac.compare_digest(x_api_key, api_key.encode())
            if not ok:
                raise ApiError(
                    401,
                    "invalid or missing API key (Authorization: Bearer <key>, or x-api-key: <key>)",
                    code="invalid_api_key",
                )
        return await handler(request)

    return middleware


def client_key(bearer: bytes, x_api_key: bytes) -> str:
    """Who the client says it is, for --prefix-cache per-key: a digest of its API key (never the key itself, which
    would then sit in the prefix index), "" for a client that sends none."""
    key = bearer.removeprefix(b"Bearer ").strip() or x_api_key.strip()
    return hashlib.sha256(key).hexdigest()[:32] if key else ""


def cors(origins: tuple[str, ...]):
    """CORS headers only for an Origin in `origins` ("*": any); none at all when `origins` is empty. A preflight
    OPTIONS from an allowed origin is answered here with 204, before auth (browsers send it without the key)."""

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        allowed = origins and origin and ("*" in origins or origin in origins)
        if request.method == "OPTIONS" and allowed:
            response: web.StreamResponse = web.Response(status=204)
        else:
            response = await handler(request)
        if allowed and not response.prepared:
            response.headers["Access-Control-Allow-Origin"] = "*" if "*" in origins else origin
            response.headers["Access-Control-Allow-Headers"] = (
                "Authorization, Content-Type, x-api-key, anthropic-version"
            )
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
        return response

    return middleware
