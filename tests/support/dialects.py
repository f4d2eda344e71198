"""A live in-process node (the tiny llama fixture, numpy engine) behind the whole HTTP API, for the API dialects'
unit tests: requests in, (status, headers, body text) out."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from node.http.api import Api, ApiSettings
from tests.unit.test_node_rpc import serving, shutdown


def exchange(requests: list[tuple[str, str, Any]], settings: ApiSettings | None = None, headers=None) -> list:
    """Each (method, path, body) sent in turn: a dict body as JSON, bytes as they are; (status, headers, text)."""

    async def go():
        node, server, peer = await serving()
        out = []
        try:
            async with TestClient(TestServer(Api(node, settings or ApiSettings()).app())) as client:
                for method, path, body in requests:
                    kw = {"json": body} if isinstance(body, (dict, list)) else {"data": body}
                    response = await asyncio.wait_for(client.request(method, path, headers=headers, **kw), 30)
                    out.append((response.status, response.headers, await asyncio.wait_for(response.text(), 30)))
        finally:
            await shutdown(node, server, peer)
        return out

    return asyncio.run(go())
