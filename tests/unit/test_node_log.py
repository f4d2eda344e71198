"""One log prefix (node/core/logs.py): every line a node writes names the node, and a line about one request names
the request, both in the text and as record attributes a handler can filter on, so no message formats them by hand."""

import logging

from node.core.logs import node_log


def test_a_nodes_lines_name_the_node_and_a_requests_lines_the_request_too(caplog):
    log = node_log("node.test", "a")
    with caplog.at_level(logging.INFO, logger="node.test"):
        log.info("peer %s joined", "b")
        log.request("r1").warning("failed: %s", "node b: KV cache memory is full")
        log.info("replaying", extra={"request": "r2"})
    assert [r.getMessage() for r in caplog.records] == [
        "node a: peer b joined",
        "node a: request r1: failed: node b: KV cache memory is full",
        "node a: request r2: replaying",
    ]
    assert [(r.node, getattr(r, "request", None)) for r in caplog.records] == [("a", None), ("a", "r1"), ("a", "r2")]


def test_binding_a_request_leaves_the_nodes_log_as_it_was(caplog):
    log = node_log("node.test", "a")
    log.request("r1")
    with caplog.at_level(logging.INFO, logger="node.test"):
        log.info("idle")
    assert [r.getMessage() for r in caplog.records] == ["node a: idle"]
