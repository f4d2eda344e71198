"""Once a stream has started, whatever goes wrong reaches the client as an OpenAI error event followed by
`data: [DONE]`: a client never waits on a stream that was cut short without a word."""

import asyncio
import json

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from node.http.api import Api
from shards.formats.tokenizer import StreamDecoder
from tests.unit.test_node_rpc import serving, shutdown

CHAT = {
    "model": "llama",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 64,  # tokens that come together go out in one chunk: some come after the first
    "stream": True,
    "temperature": 0,
}


def test_a_failure_after_the_first_chunk_is_an_error_event_then_done(monkeypatch):
    real_push, real_write = StreamDecoder.push, web.StreamResponse.write
    pushed, written = [], []

    async def write(self, data):
        written.append(data)
        return await real_write(self, data)

    def push(self, token):  # a bug in the entry's own code, once the stream has started (tokens that came
        pushed.append(token)  # together go out in one chunk: the second token may be in the first)
        if len(pushed) >= 2 and written:
            raise RuntimeError("decoder broke")
        return real_push(self, token)

    monkeypatch.setattr(StreamDecoder, "push", push)
    monkeypatch.setattr(web.StreamResponse, "write", write)

    async def go():
        node, server, peer = await serving()
        try:
            async with TestClient(TestServer(Api(node).app())) as client:
                response = await asyncio.wait_for(client.post("/v1/chat/completions", json=CHAT), 10)
                assert response.status == 200
                text = await asyncio.wait_for(response.text(), 10)
        finally:
            await shutdown(node, server, peer)
        events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert (error["type"], error["message"]) == ("server_error", "internal server error")
        assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"  # it had started

    asyncio.run(go())
