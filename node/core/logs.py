"""One log prefix for everything a node says: "node <id>: " and, for a message about one request, "request <id>: ".

Several nodes share one process in tests and in a one-machine cluster, and one request crosses several nodes: a
line that doesn't say which node wrote it, about which request, can't be followed. `NodeLog` adds both, so no
message formats them by hand (llama.cpp's server does the same with one prefix per subsystem and task id).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any


class NodeLog(logging.LoggerAdapter):
    """`logger`, its records carrying `node` (and, given per call as extra={"request": id} or bound with `request`,
    the request id) both as record attributes and as the message's prefix."""

    def __init__(self, logger: logging.Logger, node: str, extra: Mapping[str, object] | None = None):
        super().__init__(logger, {**(extra or {}), "node": node})

    def request(self, request_id: str) -> NodeLog:
        """This log, about one request."""
        return NodeLog(self.logger, str(self.extra["node"]), {**self.extra, "request": request_id})

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        extra = {**self.extra, **(kwargs.get("extra") or {})}
        kwargs["extra"] = extra
        prefix = f"node {extra['node']}: " + (f"request {extra['request']}: " if extra.get("request") else "")
        return prefix + str(msg), kwargs


def node_log(name: str, node: str) -> NodeLog:
    """The module `name`'s logger, for node `node`."""
    return NodeLog(logging.getLogger(name), node)
