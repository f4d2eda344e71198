"""Values the unit tests build again and again: the core's request specs and arrays for the llama fixture, and a
free UDP port for discovery."""

from __future__ import annotations

import socket

import numpy as np

from node.core.plan import PlanStep, RequestSpec
from shards.decoding.sampling import SamplingParams
from shards.formats.config import ModelConfig
from shards.model.shard import Shard
from tests.support.models import FIXTURES

CFG = ModelConfig.from_dir(FIXTURES / "llama")  # 6 layers, hidden 64, vocab 512
STOP = 509
ADDR = {"a": "h:1", "b": "h:2", "c": "h:3", "entry": "h:9"}


def spec(rid="r1", nodes=(("a", 0, 2), ("b", 2, 4), ("c", 4, 6)), max_tokens=3, entry="entry"):
    """A greedy request through `nodes` (id, first layer, end layer), entering and answered at `entry`."""
    plan = tuple(PlanStep(n, ADDR[n], Shard("llama", s, e, 6)) for n, s, e in nodes)
    return RequestSpec(rid, plan, SamplingParams(temperature=0), max_tokens, frozenset({STOP}), entry, ADDR[entry])


def hidden(rows=1):
    return np.zeros((rows, CFG.hidden_size), np.float32)


def logits():
    return np.zeros((1, CFG.vocab_size), np.float32)


def tokens(*ids):
    return np.array(ids, np.int64)


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
