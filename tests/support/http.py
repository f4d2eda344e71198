"""The tests' HTTP clients for a node's API: raw bytes, JSON, a chat's admission outcome, SSE streams.

`raw` is built on http.client so that a test sends exactly the bytes and headers it means (urllib would add a
Content-Type of its own to a body that has none). None of these raise on an HTTP error status: the status is what
the tests assert on.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlparse

from bench.local_cluster import http as call_json  # (status, JSON body): the launcher's own client, re-used

__all__ = ["API_KEY", "StreamEvent", "call_json", "chat_admission", "post", "raw", "stream_completion"]

API_KEY = "sk-test-key"  # the key the single_api fixture's node is started with


def raw(
    url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict | None = None,
    key: str | None = None,
    timeout: float = 30,
) -> tuple[int, dict[str, str], bytes]:
    """(status, response headers, body) of one request; a header given as None is left out (Content-Type too)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    h = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {}) | (headers or {})
    try:
        conn.request(method, path, body=body, headers={k: v for k, v in h.items() if v is not None})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def post(url: str, path: str, obj, **kw) -> tuple[int, dict[str, str], bytes]:
    """`raw` POST of `obj` as JSON."""
    return raw(url, "POST", path, json.dumps(obj).encode(), **kw)


def chat_admission(url: str, body: dict, timeout: float = 60) -> tuple[int, str | None, str | None]:
    """(status, Retry-After header, error code or None) of a chat request: whether and how the node admitted it."""
    status, headers, data = post(url, "/v1/chat/completions", body, timeout=timeout)
    if status == 200:
        return status, None, None
    return status, headers.get("Retry-After"), json.loads(data)["error"]["code"]


@dataclass
class StreamEvent:
    """One SSE event of a streamed completion, stamped when it arrived."""

    at: float  # time.monotonic() when it arrived
    text: str = ""
    finish_reason: str | None = None
    error: dict | None = None


def stream_completion(url: str, body: dict, timeout: float = 60) -> Iterator[StreamEvent]:
    """POST a streaming /v1/completions or /v1/chat/completions request; yield a StreamEvent per SSE event until
    [DONE] (the generator ends) — text chunks, the finish reason, or an in-band error."""
    request = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for chunk in response:
            line = chunk.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                yield StreamEvent(time.monotonic(), error=event["error"])
                continue
            for choice in event["choices"]:
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                yield StreamEvent(time.monotonic(), text, choice.get("finish_reason"))
