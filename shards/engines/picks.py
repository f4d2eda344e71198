"""Greedy tokens picked where the logits are: a step that returns token ids, not a vocabulary of logits per row.

A greedy request with nothing that changes its logits before the pick (no bias, no penalties, no grammar, no
logprobs) needs only its row's argmax. An engine that can reduce a row where it computed it (the ggml engine: a
graph tail on its device, shards/engines/ggml/picks.py) hands back that token, and the row's logits never leave
the device. The rule is the sampler's greedy pick (shards/decoding/sampling.py: the lowest id among equal maxima),
made exact without trusting any backend's tie-breaking: a row is picked only where its maximum is finite and
unique and the row holds no NaN, which every argmax agrees on; any other row comes back as logits, for the sampler
to take (or refuse) as it always has. So a picked token is the very token the sampler would have drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Pick:
    """One request's outcome of a picking step: its greedy token, or its last position's logits [1, vocab] where
    the token was not picked (not asked for, or not single: `host_pick`)."""

    token: int | None = None
    logits: np.ndarray | None = None

    def __post_init__(self):
        if (self.token is None) == (self.logits is None):
            raise ValueError("a pick holds a token or its row's logits, exactly one of them")
        if self.token is not None and not (isinstance(self.token, int) and self.token >= 0):
            raise ValueError(f"a picked token is a non-negative int, got {self.token!r}")
        if self.logits is not None and (self.logits.ndim != 2 or len(self.logits) != 1):
            raise ValueError(f"an unpicked row's logits are [1, vocab], got {self.logits.shape}")


def single_max(top: float, below: float, vocab: int) -> bool:
    """Whether a row whose largest value is `top` and which has `below` values strictly under it has exactly one
    finite maximum and no NaN (a NaN is neither under nor at the top, so it lowers `below` too)."""
    return bool(np.isfinite(top)) and below == vocab - 1


def host_pick(row: np.ndarray, wanted: bool = True) -> Pick:
    """The reference rule on the host, for a row [1, vocab] (or [vocab]): its argmax where `single_max` holds."""
    row = np.asarray(row, dtype=np.float32).reshape(1, -1)
    if wanted:
        top = row.max()  # NaN when the row holds one
        if np.isfinite(top) and single_max(top, int(np.count_nonzero(row < top)), row.shape[1]):
            return Pick(token=int(np.argmax(row)))
    return Pick(logits=row)
