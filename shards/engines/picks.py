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

from shards.decoding import penalties
from shards.decoding.sampling import SamplingParams

BEST = 128  # a drawn row's candidates: its 128 best logits, for a top_k up to 127


@dataclass(frozen=True)
class Draw:
    """What a sampled row asks of a picking step: its `top_k` best logits, to be scaled by `temperature` (`Draw.of`:
    a row the sampler draws from those alone). `processed`: the row's parameters where a bias or penalties that can
    only lower logits apply first (penalties.lowers_only), over its sampler's `window` as the plan froze it; top_k 1
    is such a greedy row (a plain greedy row is picked by its argmax instead)."""

    top_k: int
    temperature: float
    processed: SamplingParams | None = None
    window: tuple[int, ...] = ()

    def __post_init__(self):
        if not (isinstance(self.top_k, int) and (1 if self.processed else 2) <= self.top_k < BEST):
            raise ValueError(f"a drawn row's top_k is in [2, {BEST}) (1: a processed greedy row), got {self.top_k!r}")
        if not (isinstance(self.temperature, float) and math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"a drawn row's temperature is a finite float > 0, got {self.temperature!r}")
        if self.processed is not None and not penalties.lowers_only(self.processed):
            raise ValueError("a drawn row's bias and penalties only lower logits (penalties.lowers_only)")

    @classmethod
    def of(cls, params: SamplingParams, window: tuple[int, ...] = ()) -> Draw | None:
        """The draw of a row sampled with `params` where its token depends on its top_k best logits alone: not
        greedy, 2 <= top_k < BEST, or greedy with a bias or penalties (top_k 1); a bias and penalties only where
        they can only lower logits (`window`: its sampler's, for penalties); no grammar or logprobs (those read
        the whole row); else None."""
        if params.constraint is not None or params.top_logprobs is not None:
            return None
        processed = params if params.processed else None
        if processed is not None and not penalties.lowers_only(params):
            return None
        window = tuple(window) if processed is not None and params.penalized else ()
        if params.greedy:
            return cls(1, 1.0, processed, window) if processed is not None else None
        return cls(params.top_k, float(params.temperature), processed, window) if 2 <= params.top_k < BEST else None

    def lowered(self, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
        """The candidates' values as the sampler sees them: after the row's bias and penalties, if any."""
        return values if self.processed is None else penalties.apply_at(ids, values, self.processed, self.window)


@dataclass(frozen=True)
class Best:
    """A drawn row's candidates: ids, increasing, and their logits as the sampler sees them (after a processed
    draw's bias and penalties), holding every id the row's draw could take."""

    ids: np.ndarray  # int64 [n]
    values: np.ndarray  # float32 [n]

    def __post_init__(self):
        ids, values = self.ids, self.values
        if not (isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype == np.int64 and len(ids) >= 2):
            raise ValueError("a drawn row's candidates are 2 or more int64 ids")
        if not (isinstance(values, np.ndarray) and values.shape == ids.shape and values.dtype == np.float32):
            raise ValueError(f"a drawn row's candidates have one float32 value per id, got {values!r}")
        if not (ids[0] >= 0 and (np.diff(ids) > 0).all() and np.isfinite(values).all()):
            raise ValueError("a drawn row's candidate ids are increasing and non-negative, their values finite")


def best_of(ids: np.ndarray, values: np.ndarray, vocab: int, low: float, above: float, total: float, draw: Draw):
    """A row's `Best` for `draw` from a device's claim that `ids` (any order) are the row's highest `values`, with
    the row's own counts: `low` the lowest value among them, `above` how many of the row's values lie strictly above
    it, `total` the row's sum (finite only where no value is NaN or infinite). None where the claim fails a check,
    or an id left out could reach the draw's top k: the row's logits are read instead."""
    ids, values = np.asarray(ids, dtype=np.int64), np.asarray(values, dtype=np.float32)
    if len(ids) <= draw.top_k or values.shape != ids.shape or not math.isfinite(total):
        return None
    if not (np.isfinite(values).all() and ids.min() >= 0 and ids.max() < vocab and len(np.unique(ids)) == len(ids)):
        return None
    if low != values.min() or above != np.count_nonzero(values > low):  # an id above the lowest was left out
        return None
    order = np.argsort(ids)
    ids, values = ids[order], draw.lowered(ids[order], values[order])
    # every id left out is at most `low` (a bias or penalties only lower it further), so scales to at most `low`'s
    # scaled value (the division rounds monotonically): that must lie strictly under the k-th best scaled value
    t = np.float32(draw.temperature)
    scaled = values / t
    if not np.float32(low) / t < np.partition(scaled, len(scaled) - draw.top_k)[len(scaled) - draw.top_k]:
        return None
    return Best(ids, values)


@dataclass(frozen=True)
class Pick:
    """One request's outcome of a picking step: its greedy token for each of its rows asked (its last position, or
    every position of a block with proposals), a drawn row's candidates (`best`), or those rows' logits [rows,
    vocab] where neither was taken (not asked for, a row whose maximum is not single, candidates not taken)."""

    tokens: tuple[int, ...] | None = None
    logits: np.ndarray | None = None
    best: Best | None = None

    def __post_init__(self):
        if sum(x is not None for x in (self.tokens, self.logits, self.best)) != 1:
            raise ValueError("a pick holds its rows' tokens, their logits or a row's candidates, exactly one of them")
        if self.best is not None and not isinstance(self.best, Best):
            raise ValueError(f"a drawn row's candidates are a Best, got {type(self.best).__name__}")
        if self.tokens is not None and not (self.tokens and all(isinstance(t, int) and t >= 0 for t in self.tokens)):
            raise ValueError(f"picked tokens are non-negative ints, one per row, got {self.tokens!r}")
        if self.logits is not None and (self.logits.ndim != 2 or len(self.logits) < 1):
            raise ValueError(f"an unpicked request's logits are [rows, vocab], got {self.logits.shape}")


Want = (
    bool | Draw
)  # what a picking step asks of a request's rows: its greedy tokens (True), a draw's candidates, logits


def host_pick(rows: np.ndarray, wanted: Want = True) -> Pick:
    """The rule on the host, for a request's rows [rows, vocab] (or one row [vocab]): each row's argmax where every
    row's maximum is finite and single, else the rows (a draw's too: in host memory its sampler reads them where they
    are, as fast as candidates taken out of them). One kind of pass, twice (right after a step numpy's code is
    out of cache, and each new kind of call costs more than its pass): argmax gives the first maximum, or the first
    NaN, which numpy takes for the largest; the values after it must lie under it, and those before do."""
    rows = np.asarray(rows, dtype=np.float32)
    rows = rows.reshape(1, -1) if rows.ndim == 1 else rows
    if wanted is True:
        tokens = []
        for row in rows:
            at = int(row.argmax())
            top = row[at]
            if not math.isfinite(top) or (at + 1 < len(row) and not row[at + 1 + int(row[at + 1 :].argmax())] < top):
                return Pick(logits=rows)
            tokens.append(at)
        return Pick(tokens=tuple(tokens))
    return Pick(logits=rows)
