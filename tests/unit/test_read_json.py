"""Request bodies: a large one is parsed off the event loop, and the cheap surrogate check still refuses every
lone UTF-16 surrogate, whatever the body's size or encoding (json also reads UTF-16 and UTF-32)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from node.http import middleware
from node.http.schema import OFF_LOOP_BYTES, read_json


async def _echo(request: web.Request) -> web.Response:
    return web.json_response({"keys": sorted(await read_json(request))})


def _post(raw: bytes) -> tuple[int, dict]:
    async def go():
        app = web.Application(middlewares=[middleware.errors(4 << 20, ())], client_max_size=4 << 20)
        app.add_routes([web.post("/", _echo)])
        async with TestClient(TestServer(app)) as client:
            response = await client.post("/", data=raw, headers={"Content-Type": "application/json"})
            return response.status, await response.json()

    return asyncio.run(go())


@pytest.mark.parametrize("size", [10, 2 * OFF_LOOP_BYTES], ids=["small", "large"])
@pytest.mark.parametrize("encoding", ["utf-8", "utf-16", "utf-32"])
def test_a_lone_surrogate_is_a_400_at_any_size_and_encoding(size, encoding):
    raw = ('{"pad": "' + "x" * size + '", "text": "\\uD800"}').encode(encoding)
    status, body = _post(raw)
    assert status == 400 and body["error"]["code"] == "invalid_json" and "surrogate" in body["error"]["message"]


def test_a_large_valid_body_parses():
    status, body = _post(json.dumps({"a": "é" * OFF_LOOP_BYTES, "b": "\\ud83d\\ude00 a pair is fine"}).encode())
    assert (status, body) == (200, {"keys": ["a", "b"]})
