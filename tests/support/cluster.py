"""Live nodes on loopback for the cluster tests: the launcher (shared with bench/, which owns it so that it never
imports tests/), what a cluster's answers are compared with, and a node's memory."""

from __future__ import annotations

from bench.local_cluster import READY_API, READY_GRPC, ROOT, Cluster, NodeProc, free_port
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.config import ModelConfig
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard
from shards.reference.generate import generate
from tests.support.models import FIXTURES

__all__ = [
    "READY_API",
    "READY_GRPC",
    "ROOT",
    "Cluster",
    "NodeProc",
    "assert_matches_reference",
    "free_port",
    "reference",
    "rss_bytes",
]

MODEL = FIXTURES / "llama"


def reference(prompt: str, max_tokens: int) -> tuple[str, str]:
    """Text and finish reason from one process holding the whole model (itself proven against HF)."""
    cfg, tok = ModelConfig.from_dir(MODEL), Tokenizer(MODEL)
    engine = NumpyEngine(MODEL, Shard.whole("llama", cfg.n_layers), cfg)
    ids = [
        r.token
        for r in generate(
            [engine], tok.encode_chat([{"role": "user", "content": prompt}]), max_tokens, eos_ids=tok.eos_token_ids
        )
    ]
    return tok.decode(ids), "stop" if ids[-1] in tok.eos_token_ids else "length"


def assert_matches_reference(cluster: Cluster, prompt: str, max_tokens: int = 24, node=None) -> None:
    """The cluster's greedy chat answer is, text and finish reason, the one-process reference's."""
    status, body = cluster.chat(prompt, node=node, max_tokens=max_tokens, temperature=0)
    assert status == 200, body
    text, reason = reference(prompt, max_tokens)
    assert body["choices"][0]["message"]["content"] == text
    assert body["choices"][0]["finish_reason"] == reason


def rss_bytes(pid: int) -> int:
    """A process's resident memory, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")
