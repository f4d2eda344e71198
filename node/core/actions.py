"""What `NodeCore` answers its driver with: typed actions (`Send`, `Deliver`, `Release`, `Sample`) that the driver
(node/runtime/pipeline.py) carries out over the transport, the engines and the sampling batcher, and the names of the
ways a request ends. Plain data, so the core stays free of transport and threads and its tests can compare actions."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from node.core.requests import Activation, TokenMessage
from shards.decoding.sampling import SamplerState, SamplingParams

# Why a request ended, as entries and nodes say it (EndRequest.reason) and as the ended_* counters count it
END_REASONS = frozenset({"finished", "cancelled", "busy", "failed", "replayed", "expired"})


@dataclass(frozen=True)
class Send:
    """Activations to the next node of their plans (or sampled tokens back to the first node)."""

    address: str
    activations: tuple[Activation, ...]


@dataclass(frozen=True)
class Deliver:
    """Tokens, or the end of a request, to its entry node."""

    address: str
    message: TokenMessage


KEPT_AFTER = ("finished", "cancelled")  # ends after which a request's caches are valid and kept for prefix reuse


@dataclass(frozen=True)
class Release:
    """Free the request's KV caches (in every engine of this node); `keep`: a request that finished keeps them for
    a later request starting with the same tokens (prefix reuse: shards/engines/retained.py), within the memory
    reservations leave free; `branch`: (another retained request, n): the two share their first n positions, held
    once."""

    request_id: str
    keep: bool = False
    branch: tuple[str, int] | None = None


@dataclass(frozen=True)
class Sample:
    """Sample the next token of a request from its logits row (through the sampling batcher); with `drafts`, verify
    them: logits hold a row for each of [t, d1..dk], and the result is the accepted drafts and the token after."""

    request_id: str
    logits: np.ndarray  # [vocab], or [len(drafts) + 1, vocab] with drafts
    params: SamplingParams
    state: SamplerState
    drafts: tuple[int, ...] = ()


Action = Send | Deliver | Release | Sample
