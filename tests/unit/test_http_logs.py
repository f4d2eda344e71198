"""A request aiohttp can't parse costs one warning line in the log, never a traceback."""

import asyncio
import logging

from aiohttp import web
from aiohttp.test_utils import TestServer

from node.http import logs


def test_an_oversized_header_is_one_line_naming_the_client(caplog):
    logs.install()
    logs.install()  # once, however often

    async def go():
        app = web.Application()

        async def ok(request):
            return web.Response(text="ok")

        app.add_routes([web.get("/", ok)])
        async with TestServer(app) as server:
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
            await writer.drain()
            status = await asyncio.wait_for(reader.readline(), 5)
            writer.close()
            return status

    with caplog.at_level(logging.DEBUG, logs.SERVER_LOGGER):
        status = asyncio.run(go())
    assert status.split()[1].startswith(b"4"), status  # aiohttp answered the client itself
    (record,) = [r for r in caplog.records if r.name == logs.SERVER_LOGGER]
    line = record.getMessage()
    assert line.startswith("bad HTTP request from 127.0.0.1: LineTooLong") and "\n" not in line
    assert record.levelname == "WARNING" and record.exc_info is None and not record.exc_text
    assert len(logging.getLogger(logs.SERVER_LOGGER).filters) == 1
