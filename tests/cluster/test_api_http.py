"""Raw HTTP against a live node: SSE framing, auth, CORS, limits, and malformed requests (never a 5xx)."""

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from node.http.api import Api, ApiSettings
from tests.support.http import API_KEY, post, raw
from tests.unit.test_node_rpc import serving, shutdown

# greedy: sampled, a random model's 3 tokens may hold its stop token, and the stream then ends "stop", not "length"
CHAT = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(params=["single_api", "cluster_api"])
def api(request):
    return request.getfixturevalue(request.param)


def test_sse_framing(api):
    status, headers, data = post(api[0], "/v1/chat/completions", CHAT | {"stream": True}, key=API_KEY)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    text = data.decode()
    assert text.endswith("data: [DONE]\n\n")
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert payloads[-1]["choices"][0]["finish_reason"] == "length" and payloads[-1]["choices"][0]["delta"] == {}


def test_auth_is_required_but_healthcheck_is_open(single_api):
    url = single_api[0]
    assert raw(url, "GET", "/v1/models", key=None)[0] == 401
    status, _, data = raw(url, "GET", "/v1/models", key="wrong")
    assert status == 401 and json.loads(data)["error"]["type"] == "authentication_error"
    assert raw(url, "GET", "/healthcheck", key=None)[0] == 200
    assert raw(url, "GET", "/v1/models", key=API_KEY)[0] == 200


def test_cors_only_for_configured_origins(single_api, cluster_api):
    url = single_api[0]
    status, headers, _ = raw(
        url,
        "OPTIONS",
        "/v1/chat/completions",
        key=None,
        headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST"},
    )
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://app.example"
    _, headers, _ = raw(url, "GET", "/v1/models", headers={"Origin": "http://app.example"}, key=API_KEY)
    assert headers["Access-Control-Allow-Origin"] == "http://app.example"
    _, headers, _ = raw(url, "GET", "/v1/models", headers={"Origin": "http://evil.example"}, key=API_KEY)
    assert "Access-Control-Allow-Origin" not in headers
    _, headers, _ = raw(cluster_api[0], "GET", "/v1/models", key=None, headers={"Origin": "http://app.example"})
    assert "Access-Control-Allow-Origin" not in headers  # off by default


def test_topology_lists_nodes_links_and_shards(cluster_api):
    status, _, data = raw(cluster_api[0], "GET", "/v1/topology", key=None)
    topo = json.loads(data)
    assert status == 200 and [n["node_id"] for n in topo["nodes"]] == ["node0", "node1", "node2"]
    assert {(link["from_id"], link["to_id"]) for link in topo["links"]} == {("node0", "node1"), ("node0", "node2")}
    assert topo["nodes"][0]["pinned"] == [0, 2] and topo["nodes"][0]["capabilities"]["engine"] == "numpy"


C = "/v1/chat/completions"
P = "/v1/completions"
BAD = [
    # (path, body bytes or object, extra headers, expected status, expected param or None)
    (C, b"{", None, 400, None),
    (C, b"[]", None, 400, None),
    (C, b'"hi"', None, 400, None),
    (C, b"", None, 400, None),
    (C, b"\xff\xfe{}", None, 400, None),
    (C, b"[" * 100000 + b"]" * 100000, None, 400, None),
    (C, CHAT, {"Content-Type": "text/plain"}, 400, None),
    (C, CHAT, {"Content-Type": None}, 400, None),
    (C, {"model": "llama"}, None, 400, "messages"),
    (C, CHAT | {"messages": []}, None, 400, "messages"),
    (C, CHAT | {"messages": "hi"}, None, 400, "messages"),
    (C, CHAT | {"messages": [3]}, None, 400, "messages[0]"),
    (C, CHAT | {"messages": [{"content": "x"}]}, None, 400, "messages[0].role"),
    (C, CHAT | {"messages": [{"role": "robot", "content": "x"}]}, None, 400, "messages[0].role"),
    (C, CHAT | {"messages": [{"role": "user", "content": 5}]}, None, 400, "messages[0].content"),
    (
        C,
        CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        None,
        400,
        "messages[0].content[0]",
    ),
    (C, CHAT | {"messages": [{"role": "user", "content": ["x"]}]}, None, 400, "messages[0].content[0]"),
    (C, {k: v for k, v in CHAT.items() if k != "model"}, None, 400, "model"),
    (C, CHAT | {"model": 7}, None, 400, "model"),
    (C, CHAT | {"model": "gpt-4"}, None, 404, "model"),
    (C, CHAT | {"max_tokens": 0}, None, 400, "max_tokens"),
    (C, CHAT | {"max_tokens": -5}, None, 400, "max_tokens"),
    (C, CHAT | {"max_tokens": "10"}, None, 400, "max_tokens"),
    (C, CHAT | {"max_tokens": 1.5}, None, 400, "max_tokens"),
    (C, CHAT | {"max_tokens": True}, None, 400, "max_tokens"),
    (C, CHAT | {"max_tokens": 100000}, None, 400, "max_tokens"),
    (C, CHAT | {"max_completion_tokens": 0}, None, 400, "max_completion_tokens"),
    (C, CHAT | {"temperature": -1}, None, 400, "temperature"),
    (C, CHAT | {"temperature": "hot"}, None, 400, "temperature"),
    (
        C,
        b'{"model": "llama", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        None,
        400,
        "temperature",
    ),
    (C, CHAT | {"top_p": 1.5}, None, 400, "top_p"),
    (C, CHAT | {"top_k": -1}, None, 400, "top_k"),
    (C, CHAT | {"top_k": "a"}, None, 400, "top_k"),
    (C, CHAT | {"seed": "x"}, None, 400, "seed"),
    (C, CHAT | {"seed": 2**70}, None, 400, "seed"),
    (C, CHAT | {"stop": 5}, None, 400, "stop"),
    (C, CHAT | {"stop": ["a", "b", "c", "d", "e"]}, None, 400, "stop"),
    (C, CHAT | {"stop": [""]}, None, 400, "stop"),
    (C, CHAT | {"stop": [1]}, None, 400, "stop"),
    (C, CHAT | {"stream": "yes"}, None, 400, "stream"),
    (C, CHAT | {"stream_options": {"include_usage": True}}, None, 400, "stream_options"),
    (C, CHAT | {"stream": True, "stream_options": "usage"}, None, 400, "stream_options"),
    (C, CHAT | {"stream": True, "stream_options": {"include_usage": "yes"}}, None, 400, "include_usage"),
    (C, CHAT | {"logprobs": "yes"}, None, 400, "logprobs"),
    (C, CHAT | {"logprobs": True, "top_logprobs": 21}, None, 400, "top_logprobs"),
    (C, CHAT | {"top_logprobs": 2}, None, 400, "top_logprobs"),
    (C, CHAT | {"n": 2}, None, 400, "n"),
    (C, CHAT | {"n": 0}, None, 400, "n"),
    (C, CHAT | {"presence_penalty": 2.5}, None, 400, "presence_penalty"),
    (C, CHAT | {"frequency_penalty": 9}, None, 400, "frequency_penalty"),
    (C, CHAT | {"repeat_penalty": 0}, None, 400, "repeat_penalty"),
    (C, CHAT | {"repeat_penalty": 1.1, "repetition_penalty": 1.1}, None, 400, "repetition_penalty"),
    (C, CHAT | {"repeat_last_n": 5000}, None, 400, "repeat_last_n"),
    (C, CHAT | {"min_p": -0.1}, None, 400, "min_p"),
    (C, CHAT | {"tools": [{"type": "function", "function": {"name": "f f"}}]}, None, 400, "tools[0].function.name"),
    (C, CHAT | {"response_format": {"type": "yaml"}}, None, 400, "response_format"),
    (C, CHAT | {"logit_bias": {"5": 101}}, None, 400, "logit_bias"),
    (C, CHAT | {"logit_bias": {"-5": 1}}, None, 400, "logit_bias"),
    (C, CHAT | {"logit_bias": ["5"]}, None, 400, "logit_bias"),
    (C, CHAT | {"logit_bias": {"99999": -100}}, None, 400, "logit_bias"),
    (C, CHAT | {"messages": [{"role": "user", "content": "word " * 400}]}, None, 400, "messages"),
    (C, b"{" + b'"a":' * 0 + b'"x": "' + b"y" * (2 << 20) + b'"}', None, 413, None),
    (P, {"model": "llama"}, None, 400, "prompt"),
    (P, {"model": "llama", "prompt": ""}, None, 400, "prompt"),
    (P, {"model": "llama", "prompt": []}, None, 400, "prompt"),
    (P, {"model": "llama", "prompt": [-1]}, None, 400, "prompt"),
    (P, {"model": "llama", "prompt": ["a", "b"]}, None, 400, "prompt"),
    (P, {"model": "llama", "prompt": [99999]}, None, 400, "prompt"),
    (P, {"model": "llama", "prompt": "x", "suffix": "y"}, None, 400, "suffix"),
    (P, {"model": "llama", "prompt": "x", "logprobs": 6}, None, 400, "logprobs"),
    (P, {"model": "llama", "prompt": "x", "echo": "yes"}, None, 400, "echo"),
    (P, {"model": "llama", "prompt": "x", "best_of": 3}, None, 400, "best_of"),
    ("/v1/nothing-here", CHAT, None, 404, None),
]


@pytest.mark.parametrize("path,body,headers,status,param", BAD, ids=range(len(BAD)))
def test_malformed_requests_get_a_clear_4xx_error_object(api, path, body, headers, status, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, _, raw_body = raw(api[0], "POST", path, data, headers=headers, key=API_KEY)
    assert got == status, raw_body[:300]
    error = json.loads(raw_body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_wrong_method_is_405_with_an_error_object(single_api):
    status, _, data = raw(single_api[0], "GET", "/v1/chat/completions", key=API_KEY)
    assert status == 405 and json.loads(data)["error"]["code"] == "method_not_allowed"


def test_node_still_serves_after_all_that(api):
    assert post(api[0], C, CHAT, key=API_KEY)[0] == 200


def test_beyond_max_concurrent_requests_is_503_overloaded():
    async def go():
        node, server, peer = await serving()
        api = Api(node, ApiSettings(max_concurrent=1))
        async with TestClient(TestServer(api.app())) as client:
            ok = await client.post(C, json=CHAT)
            assert ok.status == 200
            api.active = 1  # one request is generating
            busy = await client.post(C, json=CHAT)
            assert busy.status == 503 and (await busy.json())["error"]["code"] == "server_overloaded"
        await shutdown(node, server, peer)

    asyncio.run(go())
