"""A streamed answer's writes (node/http/chat.py `write`): a client that keeps reading gets every chunk; one that stops
reading is cut off after WRITE_TIMEOUT_S (the request is cancelled like a disconnect), whether or not its earlier
writes took the path without a timer."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from node.http import chat

CHUNK = b"data: " + b"x" * 4096 + b"\n\n"  # a few tokens' worth: the writes take the path without a timer


async def _serve(outcome: dict, chunks: int) -> tuple[web.AppRunner, int]:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            for i in range(chunks):
                await chat.write(request, response, CHUNK)
                outcome["written"] = i + 1
        except asyncio.CancelledError:
            outcome["cancelled"] = True
            raise
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def test_a_reading_client_gets_every_chunk():
    async def main():
        outcome: dict = {}
        runner, port = await _serve(outcome, chunks=200)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            body = await asyncio.wait_for(reader.read(-1), 20)
            writer.close()
        finally:
            await runner.cleanup()
        return outcome, body

    outcome, body = asyncio.run(main())
    assert outcome == {"written": 200}
    assert body.count(b"data: ") == 200


def test_a_client_that_stops_reading_is_cancelled_after_the_write_timeout(monkeypatch):
    monkeypatch.setattr(chat, "WRITE_TIMEOUT_S", 0.5)

    async def main():
        outcome: dict = {}
        runner, port = await _serve(outcome, chunks=1_000_000)  # far more than any socket buffers hold
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # and never reads
            for _ in range(200):
                if outcome.get("cancelled"):
                    break
                await asyncio.sleep(0.1)
        finally:
            sock.close()
            await runner.cleanup()
        return outcome

    outcome = asyncio.run(main())
    assert outcome.get("cancelled") is True
    assert 0 < outcome["written"] < 1_000_000  # the first writes went out without waiting
