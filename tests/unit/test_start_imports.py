"""A node imports at start only what it serves with: every live cluster test starts several nodes, and each module a
node doesn't need is paid again at every start.

The seam is the real one: `python -X importtime -m node.cli` logs every module as it is imported, and the node prints
its ready line once it serves gRPC, so the modules logged before that line are exactly the start path's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from bench.local_cluster import READY_GRPC, ROOT
from tests.support.models import FIXTURES

# What a node without an API or a cluster key, serving a safetensors folder, has no use for at start: the HTTP layer
# (aiohttp, prometheus exposition, the API dialects), chat templates, TLS, the GGUF reader (and its yaml), and the
# engines not chosen.
NOT_AT_START = (
    "aiohttp",
    "node.http",
    "jinja2",
    "cryptography",
    "node.security.tls",
    "gguf",
    "yaml",
    "tinygrad",
    "mlx",
)
IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)")


def start_imports(*flags: str) -> set[str]:
    """The modules a node imports from its launch to its ready line (the node is stopped then)."""
    args = ["--model", str(FIXTURES / "llama"), "--host", "127.0.0.1", "--grpc-port", "0", "--discovery", "none"]
    env = {k: v for k, v in os.environ.items() if k != "EXO_NODE_CLUSTER_KEY"}  # no key: the plaintext start
    cmd = [sys.executable, "-X", "importtime", "-m", "node.cli", *args, "--speed", "1", "--engine", "numpy", *flags]
    # One pipe for both streams: the log (stderr) and the ready line (stdout, flushed) arrive in the order written.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    imported, lines = set(), []
    try:
        for line in proc.stdout:
            if READY_GRPC.search(line):
                return imported
            if m := IMPORTED.match(line):
                imported.add(m[1])
            else:
                lines.append(line)
        raise AssertionError(f"the node exited before it was ready: {''.join(lines[-20:])}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_node_without_an_api_serves_without_the_http_layer_templates_tls_or_other_engines():
    imported = start_imports("--no-api", "--log-level", "warning")
    assert {"node.grpc.server", "node.runtime.node", "numpy"} <= imported  # the log was read: the start path is there
    loaded = sorted(m for m in imported if any(m == h or m.startswith(h + ".") for h in NOT_AT_START))
    assert not loaded, f"imported at a --no-api start: {loaded}; import them where they are used (see node/cli.py)"
