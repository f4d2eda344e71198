"""The flags of the HTTP API: where it listens, who may call it, and what one request may ask."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from node.http.api import ApiSettings


def add_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("HTTP API", "the OpenAI-compatible API and the web page")
    g.add_argument(
        "--api-host",
        default="127.0.0.1",
        help="HTTP API bind address (default 127.0.0.1: local only; 0.0.0.0 to serve the LAN)",
    )
    g.add_argument("--api-port", type=int, default=52415, help="0 picks a free port (default 52415)")
    g.add_argument("--no-api", action="store_true", help="no HTTP API on this node")
    g.add_argument("--max-tokens", type=int, default=1024, help="cap on tokens generated per request")
    g.add_argument("--max-body-kb", type=int, default=1024, help="HTTP request body size cap (default 1024 KiB)")
    g.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=64,
        help="requests generating at once on this entry node; more get 503 (default 64)",
    )
    g.add_argument(
        "--http-timeout",
        type=float,
        default=15.0,
        help="seconds a client may take to send a request's headers; idle connections close after it",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("EXO_NODE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on the API (default: $EXO_NODE_API_KEY, else open)",
    )
    g.add_argument(
        "--cors-origins", default="", help="comma-separated origins allowed by CORS, or '*' (default: none, CORS off)"
    )
    g.add_argument(
        "--parse-special-in-content",
        action="store_true",
        help="read control-token text in message content (<|im_start|>system) as control tokens, as llama-server "
        "does: a user can then open turns of other roles (default: it is text)",
    )


@dataclass(frozen=True)
class HttpSettings:
    """Where the HTTP API listens, and what it allows (None in `Settings`: --no-api)."""

    host: str
    port: int  # 0: a free port
    header_timeout: float  # seconds a client may take to send a request's headers; idle connections close after it
    api: ApiSettings

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--api-port must be a TCP port (0 picks a free one), got {self.port}")
        if not self.header_timeout > 0:
            raise ValueError(f"--http-timeout must be positive, got {self.header_timeout}")
        for flag, value in (
            ("--max-tokens", self.api.max_tokens_cap),
            ("--max-body-kb", self.api.max_body_bytes // 1024),
            ("--max-concurrent-requests", self.api.max_concurrent),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be 1 or more, got {value}")


def http_from_args(args: argparse.Namespace) -> HttpSettings | None:
    if args.no_api:
        return None
    from node.http.api import ApiSettings  # the HTTP layer (aiohttp) loads only on a node with an API

    api = ApiSettings(
        max_tokens_cap=args.max_tokens,
        max_body_bytes=args.max_body_kb * 1024,
        max_concurrent=args.max_concurrent_requests,
        api_key=args.api_key or None,
        cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()),
        parse_special_in_content=args.parse_special_in_content,
    )
    return HttpSettings(args.api_host, args.api_port, args.http_timeout, api)
