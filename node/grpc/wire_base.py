"""The wire's limits and the checks every decoder is built on (node/grpc/wire.py, wire_sampling.py,
wire_cluster.py): every value that came from the network passes one of them or raises `WireError`, which the gRPC
server maps to INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import Sized
from typing import TypeVar

import numpy as np

# Caps on repeated fields and strings: far above anything legitimate, low enough that a hostile message
# cannot make a node do unbounded work or hold unbounded state.
MAX_MODEL_ID = 256
MAX_NAME = 256  # node ids, addresses, engine names, status keys
MAX_DIMS = 4
MAX_PLAN_STEPS = 64
MAX_STOP_IDS = 1024
MAX_TOKENS_PER_MESSAGE = 1024
MAX_MESSAGES = 4096  # token messages or activations in one call
MAX_ERROR = 4096
MAX_GRAMMAR_PREFIX = 1 << 17  # tokens generated before a replay (at most a context)
FINISH_REASONS = ("", "stop", "length", "error")
_UINT64 = 2**64


class WireError(ValueError):
    """A message from the network is malformed or violates a limit."""


def _text(value: str, what: str, max_len: int = MAX_NAME, required: bool = True) -> str:
    if required and not value:
        raise WireError(f"{what} is missing")
    if len(value) > max_len:
        raise WireError(f"{what} is longer than {max_len} characters")
    return value


_S = TypeVar("_S", bound=Sized)


def _count(items: _S, what: str, limit: int) -> _S:
    if len(items) > limit:
        raise WireError(f"too many {what}: {len(items)} > {limit}")
    return items


def _f32(x: float) -> float:
    """The wire stores float32; give back the shortest decimal that round-trips to the same float32 (0.7, not
    0.699999988). It is a pure function of the bits, so every node decodes the same value; unlike rounding to
    a fixed number of digits it keeps tiny values (temperature 1e-7 stays non-zero)."""
    return float(np.format_float_scientific(np.float32(x), unique=True))
