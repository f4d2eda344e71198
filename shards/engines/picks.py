"""Greedy tokens picked where the logits are: a step that returns token ids, not a vocabulary of logits per row.

A greedy request with nothing that changes its logits before the pick (no bias, no penalties, no grammar, no
logprobs) needs only its rows' argmax: its last position's, or each position's of a block of proposals to verify.
An engine that can reduce a row where it computed it (the ggml engine on a device: a graph tail, shards/engines/ggml/
picks.py) hands back those tokens, and the rows' logits never leave the device; one whose logits are in host memory
picks them there (`host_pick`), with numpy's vector loops. The rule is the sampler's greedy pick (shards/decoding/
sampling.py: the lowest id among equal maxima), made exact without trusting any backend's tie-breaking: a row is
picked only where its maximum is finite and single and the row holds no NaN, which every argmax agrees on; a
request with any other row comes back as its rows' logits, for the sampler to take (or refuse) as it always has. So
a picked token is the very token the sampler would have drawn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Pick:
    """One request's outcome of a picking step: its greedy token for each of its rows asked (its last position, or
    every position of a block with proposals), or those rows' logits [rows, vocab] where not every row was picked
    (not asked for, or a row whose maximum is not single)."""

    tokens: tuple[int, ...] | None = None
    logits: np.ndarray | None = None

    def __post_init__(self):
        if (self.tokens is None) == (self.logits is None):
            raise ValueError("a pick holds its rows' tokens or their logits, exactly one of them")
        if self.tokens is not None and not (self.tokens and all(isinstance(t, int) and t >= 0 for t in self.tokens)):
            raise ValueError(f"picked tokens are non-negative ints, one per row, got {self.tokens!r}")
        if self.logits is not None and (self.logits.ndim != 2 or len(self.logits) < 1):
            raise ValueError(f"an unpicked request's logits are [rows, vocab], got {self.logits.shape}")


def host_pick(rows: np.ndarray, wanted: bool = True) -> Pick:
    """The rule on the host, for a request's rows [rows, vocab] (or one row [vocab]): each row's argmax where every
    row's maximum is finite and single, else the rows. One kind of pass, twice (right after a step numpy's code is
    out of cache, and each new kind of call costs more than its pass): argmax gives the first maximum, or the first
    NaN, which numpy takes for the largest; the values after it must lie under it, and those before do."""
    rows = np.asarray(rows, dtype=np.float32)
    rows = rows.reshape(1, -1) if rows.ndim == 1 else rows
    if wanted:
        tokens = []
        for row in rows:
            at = int(row.argmax())
            top = row[at]
            if not math.isfinite(top) or (at + 1 < len(row) and not row[at + 1 + int(row[at + 1 :].argmax())] < top):
                return Pick(logits=rows)
            tokens.append(at)
        return Pick(tokens=tuple(tokens))
    return Pick(logits=rows)
