"""Token sampling: greedy, temperature, top-k, top-p, on one row or a stacked batch of rows.

Every row is sampled independently of the others (no cross-row coupling): each request owns a `SamplerState`
whose RNG draws exactly one uniform per sampled (non-greedy) token, and the candidate set and its order are
defined canonically (ties broken by lower token id). So a seeded request gets the same tokens whether it is
sampled alone, in a batch of 8, or through a fallback path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MAX_TOP_LOGPROBS = 20
# top-p first looks for the nucleus among this many most likely tokens; it sorts the whole row only when
# they don't reach top_p (a nearly flat distribution).
_NUCLEUS_PRESELECT = 1024


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    top_logprobs: int | None = None  # None: no logprobs; 0..20: chosen token's logprob plus that many alternatives

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and self.seed >= 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.top_logprobs is not None and not (
            isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class SamplerState:
    """A request's private random stream."""

    rng: np.random.Generator = field(default_factory=np.random.default_rng)

    @classmethod
    def from_seed(cls, seed: int | None) -> "SamplerState":
        return cls(np.random.default_rng(seed))


@dataclass(frozen=True)
class SampleResult:
    token: int
    logprob: float | None = None  # log-probability of `token` under the model's (untempered) distribution
    top_logprobs: tuple[tuple[int, float], ...] = ()


def sample_rows(logits: np.ndarray, params: list[SamplingParams], states: list[SamplerState]) -> list[SampleResult]:
    """Sample one token for each row of `logits` [N, vocab]."""
    logits = np.asarray(logits, dtype=np.float32)
    if logits.ndim != 2 or logits.shape[0] != len(params) or len(params) != len(states):
        raise ValueError(f"logits {logits.shape} do not match {len(params)} params / {len(states)} states")
    temps = np.array([p.temperature if not p.greedy else 1.0 for p in params], dtype=np.float32)
    scaled = logits / temps[:, None]
    # Elementwise and last-axis ops are computed row by row, so batching never changes a row's result.
    probs = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    out = []
    for i, p in enumerate(params):
        if p.greedy:
            token = int(np.argmax(logits[i]))
        else:
            token = _draw(scaled[i], probs[i], p, states[i].rng)
        out.append(_with_logprobs(logits[i], token, p.top_logprobs))
    return out


def sample_one(logits: np.ndarray, params: SamplingParams, state: SamplerState) -> SampleResult:
    """Sample from a single row [vocab] (the same code path as a batch of one)."""
    return sample_rows(np.asarray(logits, dtype=np.float32).reshape(1, -1), [params], [state])[0]


def _draw(scaled: np.ndarray, probs: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    vocab = len(scaled)
    if p.top_k and p.top_k < vocab:
        # Keep the k best ids, ties at the boundary resolved towards lower ids.
        cand = _best_ids(scaled, p.top_k)
    elif p.top_p < 1.0:
        cand = _best_ids(scaled, min(_NUCLEUS_PRESELECT, vocab))
        if len(cand) < vocab and probs[cand].sum(dtype=np.float64) < p.top_p * probs.sum(dtype=np.float64):
            cand = _best_ids(scaled, vocab)
    else:
        cand = None
    if cand is None:
        w = probs.astype(np.float64)
    else:
        w = probs[cand].astype(np.float64)
        if p.top_p < 1.0:
            mass = np.cumsum(w)
            # After a top-k cut the nucleus is taken within the k survivors (as HF chains the two filters).
            cut_by_k = bool(p.top_k) or len(cand) == vocab
            total = mass[-1] if cut_by_k else probs.sum(dtype=np.float64)
            # Keep the shortest prefix whose mass reaches top_p (the token that crosses it is kept).
            keep = int(np.searchsorted(mass, p.top_p * total, side="left")) + 1
            cand, w = cand[:keep], w[:keep]
    cdf = np.cumsum(w)
    j = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(cdf) - 1)
    return int(j if cand is None else cand[j])


def _best_ids(scores: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k highest scores, best first; equal scores ordered by id (canonical, batch independent)."""
    if k < len(scores):
        kth = np.partition(scores, len(scores) - k)[len(scores) - k]
        ids = np.flatnonzero(scores >= kth)  # includes every tie with the k-th value
    else:
        ids = np.arange(len(scores))
    order = np.lexsort((ids, -scores[ids]))
    return ids[order][:k]


def _with_logprobs(row: np.ndarray, token: int, top: int | None) -> SampleResult:
    if top is None:
        return SampleResult(token)
    m = row.max()
    logz = float(m) + math.log(float(np.exp(row - m, dtype=np.float64).sum()))
    alts = tuple((int(t), float(row[t]) - logz) for t in _best_ids(row, top)) if top else ()
    return SampleResult(token, float(row[token]) - logz, alts)
