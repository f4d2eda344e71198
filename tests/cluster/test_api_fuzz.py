"""Hostile HTTP input: whatever a client sends, the answer is a clear 4xx (or a real answer), never a 5xx, and the
node stays alive; clients that trickle their headers are disconnected."""

import json
import socket
from urllib.parse import urlparse

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.cluster import Cluster
from tests.support.http import post, raw
from tests.support.models import FIXTURES

KNOWN = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "n",
    "echo",
    "suffix",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_p",
    "repeat_penalty",
    "repetition_penalty",
    "repeat_last_n",
    "tools",
    "response_format",
    "best_of",
]
huge = st.integers(min_value=-(10**4000), max_value=10**4000)
text = st.text(
    alphabet=st.characters(codec="utf-8") | st.sampled_from(["\ud800", "\udfff", "\x00", "\u202e"]), max_size=40
)
leaf = st.none() | st.booleans() | st.integers(-3, 40) | huge | st.floats(allow_nan=False) | text
value = st.recursive(
    leaf,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["role", "content", "type", "text", "include_usage"]) | text, inner, max_size=4
        )
    ),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "?"]), "content": text | value}
)
body = st.fixed_dictionaries(
    {"model": st.sampled_from(["llama", "other"]) | text},
    optional={key: value for key in KNOWN if key != "model"}
    | {"messages": st.lists(message, max_size=3), "max_tokens": st.integers(-2, 8)},
)


def encode(obj) -> bytes:
    """JSON as a client may send it: lone surrogates escaped (json.dumps does), huge integers spelled out."""
    return json.dumps(obj).encode()


def test_random_bodies_never_get_a_5xx_and_the_node_lives_on(single_api):
    url, key = single_api

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body, st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    def check(obj, path):
        status, _, data = raw(url, "POST", path, encode(obj), key=key)
        assert status < 500, (obj, data[:300])
        if status >= 400:
            assert "message" in json.loads(data)["error"]

    check()
    assert raw(url, "GET", "/healthcheck", key=None)[0] == 200


def test_the_two_bodies_that_gave_500s_are_400s_with_clear_messages(single_api):
    url, key = single_api
    surrogate = {"model": "llama", "messages": [{"role": "user", "content": "\ud800"}]}
    status, _, data = raw(url, "POST", "/v1/chat/completions", encode(surrogate), key=key)
    assert status == 400 and "surrogate" in json.loads(data)["error"]["message"]
    long_number = (
        b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "temperature": 1' + b"0" * 5000 + b"}"
    )
    status, _, data = raw(url, "POST", "/v1/chat/completions", long_number, key=key)
    assert status == 400 and "not valid JSON" in json.loads(data)["error"]["message"]
    status, _, data = post(
        url,
        "/v1/chat/completions",
        surrogate | {"messages": [{"role": "user", "content": "x"}], "temperature": 10**400},
        key=key,
    )
    assert status == 400 and "'temperature' must be a number" in json.loads(data)["error"]["message"]


def test_clients_that_trickle_their_headers_are_disconnected():
    with Cluster(FIXTURES / "llama", 1, extra=["--http-timeout", "2"]) as c:
        u = urlparse(c.nodes[0].api_url)
        socks = []
        for _ in range(50):
            s = socket.create_connection((u.hostname, u.port), timeout=10)
            s.sendall(b"GET /healthcheck HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends the headers
            socks.append(s)
        closed = 0
        for s in socks:  # a socket still open after 10 s raises TimeoutError: the test fails
            try:
                s.sendall(b"X-Slow: 1\r\n")
                closed += s.recv(1) == b""  # the server hung up without answering
            except ConnectionError:  # reset, or a broken pipe: hung up too
                closed += 1
            s.close()
        assert closed == 50
        status = raw(c.nodes[0].api_url, "GET", "/healthcheck", key=None)[0]
        assert status == 200  # and real clients are still served
