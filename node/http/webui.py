"""The web page every node with an API serves at `/`: plain HTML, CSS and JS committed in node/http/web/, no build step.

The page itself and its assets are public even with --api-key: they hold no data, and the page asks for the key and
sends it with every API call. Its Content-Security-Policy allows nothing but this node, so the page works on a
machine without internet and can never pull in a script from elsewhere.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

WEB = Path(__file__).resolve().parent / "web"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def is_public(path: str) -> bool:
    """Paths served without the API key."""
    return path in ("/", "/healthcheck") or path.startswith("/static/")


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(WEB / "index.html", headers={"Cache-Control": "no-cache"})


@web.middleware
async def security_headers(request: web.Request, handler) -> web.StreamResponse:
    response = await handler(request)
    if request.path == "/" or request.path.startswith("/static/"):
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
    return response


def routes() -> list[web.AbstractRouteDef]:
    return [web.get("/", index), web.static("/static", WEB)]
