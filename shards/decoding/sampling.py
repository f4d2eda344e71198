"""Token sampling: greedy, temperature, top-k, top-p, min-p, after the logit bias and repetition penalties
(shards/decoding/penalties.py), on one row or a stacked batch of rows.

Every row is sampled independently of the others (no cross-row coupling): each request owns a `SamplerState`
whose RNG draws exactly one uniform per sampled (non-greedy) token, and the candidate set and its order are
defined canonically (ties broken by lower token id). So a seeded request gets the same tokens whether it is
sampled alone, in a batch of 8, or through a fallback path.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from shards.decoding import penalties
from shards.decoding.grammar import Constraint, Matcher

MAX_TOP_LOGPROBS = 20
# top-p looks for the nucleus among this many most likely tokens, then this many, and sorts the whole row only
# when they don't reach top_p (a nearly flat distribution).
_NUCLEUS_PRESELECT = (1024, 8192)
# the best k ids are looked for among the ids scoring at least the k-th best of every this-many-th score
_SAMPLE_STRIDE = 16


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    top_logprobs: int | None = None  # None: no logprobs; 0..20: chosen token's logprob plus that many alternatives
    constraint: Constraint | None = None  # a grammar every token must follow (applied by the sampling batcher)
    speculate: bool = True  # False: the client opted out of speculative decoding (node/core/speculation.py)
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest (after temperature, top-k, top-p)
    presence_penalty: float = 0.0  # penalties over the window of recent tokens: shards/decoding/penalties.py
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    penalty_last_n: int = penalties.DEFAULT_WINDOW  # the window: the last tokens of the prompt and the sampled
    penalty_context: tuple[int, ...] = ()  # the window's start: the prompt's tail (set by the entry node)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids increasing

    def __post_init__(self) -> None:
        if not isinstance(self.speculate, bool):
            raise ValueError(f"speculate must be a boolean, got {self.speculate!r}")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError(f"constraint must be a Constraint, got {type(self.constraint).__name__}")
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
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
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        penalties.check(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing changing the logits before the argmax (no bias or penalties) and no logprobs asked."""
        return self.greedy and not self.processed and self.top_logprobs is None

    @property
    def pickable(self) -> bool:
        """Whether a row's token is its logits' argmax and nothing else is asked of them (plain greedy, no grammar):
        an engine may pick it where it computed them (shards/engines/picks.py)."""
        return self.plain_greedy and self.constraint is None

    @property
    def penalized(self) -> bool:
        """Whether its recent tokens change a row's logits (its sampler then keeps a window of them)."""
        return penalties.penalizes(self)

    @property
    def processed(self) -> bool:
        """Whether a row's logits are changed before the pick (a bias or penalties)."""
        return bool(self.logit_bias) or self.penalized


@dataclass
class SamplerState:
    """A request's private random stream, its grammar state when the request is constrained (made by the
    sampling batcher at the first token, dropped with the request), and its window of recent tokens when it is
    penalized (started from its params' `penalty_context` at the first token, then each sampled token)."""

    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    matcher: Matcher | None = None
    recent: deque[int] | None = None

    @classmethod
    def from_seed(cls, seed: int | None, skip: int = 0) -> SamplerState:
        """A stream from `seed`, `skip` draws in: where a request that already sampled `skip` tokens (not greedily)
        left it, so a replay elsewhere continues with the very numbers the first attempt would have used."""
        state = cls(np.random.default_rng(seed))
        if skip:
            state.rng.random(skip)  # exactly one uniform per sampled token (see the module docstring)
        return state

    def window(self, params: SamplingParams) -> deque[int]:
        """The recent tokens the penalties count (the prompt's tail until tokens are sampled)."""
        if self.recent is None:
            self.recent = deque(params.penalty_context, maxlen=params.penalty_last_n)
        return self.recent

    def snapshot(self) -> tuple:
        recent = None if self.recent is None else (tuple(self.recent), self.recent.maxlen)
        return self.rng.bit_generator.state, recent

    def restore(self, snapshot: tuple) -> None:
        """Rewind the stream and the window, e.g. after a batched call that failed part-way, so a retry draws the
        same numbers from the same logits."""
        self.rng.bit_generator.state, recent = snapshot
        self.recent = None if recent is None else deque(recent[0], maxlen=recent[1])


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
    raw, tokens = logits, [0] * len(params)
    if any(p.processed for p in params):  # biased and penalized rows: their own copies
        logits = logits.copy()
        for i, p in enumerate(params):
            if p.processed:
                logits[i] = penalties.apply(raw[i], p, states[i].window(p) if p.penalized else ())
    greedy = [i for i, p in enumerate(params) if p.greedy]
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    # The O(vocab) work is vectorized over rows. Elementwise and last-axis ops are computed row by row, so
    # batching never changes a row's result.
    if greedy:  # every row greedy (a lone row): argmax over them in place, not over a copy of their rows
        rows = logits if len(greedy) == len(params) else logits[greedy]
        for i, t in zip(greedy, np.argmax(rows, axis=1)):
            tokens[i] = int(t)  # argmax picks the lowest id among equal maxima
    if drawn:
        temps = np.array([params[i].temperature for i in drawn], dtype=np.float32)
        scaled = logits[drawn] / temps[:, None]
        for j, i in enumerate(drawn):
            tokens[i] = _draw(scaled[j], params[i], states[i].rng)
    for i, p in enumerate(params):
        if p.penalized:
            states[i].window(p).append(tokens[i])
    # logprobs are the model's own distribution's (the raw row), as the OpenAI API reports them
    return [_with_logprobs(raw[i], tokens[i], p.top_logprobs) for i, p in enumerate(params)]


def sample_one(logits: np.ndarray, params: SamplingParams, state: SamplerState) -> SampleResult:
    """Sample from a single row [vocab] (the same code path as a batch of one)."""
    return sample_rows(np.asarray(logits, dtype=np.float32).reshape(1, -1), [params], [state])[0]


def sample_best(ids: np.ndarray, values: np.ndarray, params: SamplingParams, state: SamplerState) -> SampleResult:
    """A row's token from candidates: `ids`, increasing, and their logits after the row's bias and penalties,
    holding every id that could reach the row's top k (its maximum, greedy) (shards/engines/picks.py `best_of`).
    The same token as `sample_rows` over the whole row, bit for bit: the candidates scaled as the row's values are,
    ranked with ties by id as the row's are (their positions are in id order), the same one uniform drawn (none
    for a greedy row: the lowest id among equal maxima); the token joins the penalties' window as there."""
    if (
        not (params.greedy and params.processed or 0 < params.top_k < len(ids))
        or params.top_logprobs is not None
        or params.constraint
    ):
        raise ValueError(
            f"a row drawn from {len(ids)} candidates is a top-k row under that or a processed greedy one, with no "
            "logprobs or grammar"
        )
    if params.greedy:
        token = int(ids[int(np.argmax(values))])  # the first maximum: ids increase
    else:
        scaled = np.asarray(values, dtype=np.float32) / np.float32(params.temperature)
        token = int(ids[_draw(scaled, params, state.rng)])
    if params.penalized:
        state.window(params).append(token)
    return SampleResult(token)


def _draw(scaled: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    """Inverse-CDF draw over the surviving ids taken in id order, with one uniform from the request's RNG. A
    token's probability is exp(scaled - max) (the likeliest token's is 1), computed for the ids a step needs: after
    a top-k cut only the k survivors' (elementwise, so the same numbers as over the whole row)."""
    top = scaled.max()
    probs = None  # the whole row's, once a step needs them

    def at(ids: np.ndarray | None) -> np.ndarray:
        nonlocal probs
        if ids is None or probs is not None:
            probs = np.exp(scaled - top) if probs is None else probs
            return probs if ids is None else probs[ids]
        return np.exp(scaled[ids] - top)

    ids = None  # None: every id survives
    if p.top_k and p.top_k < len(scaled):
        ids = _best_ids(scaled, p.top_k)
        if p.top_p < 1.0:  # the nucleus is taken within the k survivors, as HF chains the two filters
            mass = np.cumsum(at(ids), dtype=np.float64)
            ids = ids[: int(np.searchsorted(mass, p.top_p * mass[-1], side="left")) + 1]
    elif p.top_p < 1.0:
        ids = _nucleus(scaled, at(None), p.top_p)
    if p.min_p > 0:  # the likeliest token's probability is 1
        kept = np.flatnonzero(at(None) >= np.float32(p.min_p)) if ids is None else ids[at(ids) >= np.float32(p.min_p)]
        ids = kept
    if ids is not None:
        ids = np.sort(ids)
    cdf = np.cumsum(at(ids), dtype=np.float64)
    j = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(cdf) - 1)
    return int(j if ids is None else ids[j])


def _nucleus(scaled: np.ndarray, probs: np.ndarray, top_p: float) -> np.ndarray:
    """The shortest best-first prefix of ids whose probability mass reaches top_p (the crossing id included)."""
    target = top_p * probs.sum(dtype=np.float64)
    for k in _NUCLEUS_PRESELECT:  # usual case: a peaked distribution, the nucleus is among a few best
        if len(scaled) <= 2 * k:
            break
        ids = _best_ids(scaled, k)  # the row's best-first prefix: the same masses, summed in the same order
        mass = np.cumsum(probs[ids], dtype=np.float64)
        if mass[-1] >= target:
            return ids[: int(np.searchsorted(mass, target, side="left")) + 1]
    # A flat distribution: find the threshold probability from the sorted values (no index sort needed), then
    # keep everything above it and the lowest ids among the ties at it.
    ranked = np.sort(probs)[::-1]
    n = min(int(np.searchsorted(np.cumsum(ranked, dtype=np.float64), target, side="left")), len(ranked) - 1) + 1
    threshold = ranked[n - 1]
    above = np.flatnonzero(probs > threshold)
    return np.concatenate([above, np.flatnonzero(probs == threshold)[: n - len(above)]])


def _best_ids(scores: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k highest scores, best first; equal scores ordered by id (canonical, batch independent)."""
    if k < len(scores):
        pool = _at_least_kth(scores, k)
        sub = scores[pool]
        kth = np.partition(sub, len(sub) - k)[len(sub) - k]  # the row's k-th highest: the pool holds the k highest
        ids = pool[sub >= kth]  # includes every tie with the k-th value, in id order
    else:
        ids = np.arange(len(scores))
    order = np.lexsort((ids, -scores[ids]))
    return ids[order][:k]


def _at_least_kth(scores: np.ndarray, k: int) -> np.ndarray:
    """Ids, in order, of every score at or above the k-th highest: those at or above the k-th highest of every
    stride-th score (at most the row's: the row holds that sample's k scores), so a partition runs over a few times
    k scores rather than the vocabulary; every id where a sample could not hold k scores."""
    stride = min(_SAMPLE_STRIDE, len(scores) // (4 * k))
    if stride < 2:
        return np.arange(len(scores))
    sample = scores[::stride]
    floor = np.partition(sample, len(sample) - k)[len(sample) - k]
    return np.flatnonzero(scores >= floor)


def _with_logprobs(row: np.ndarray, token: int, top: int | None) -> SampleResult:
    if top is None:
        return SampleResult(token)
    m = row.max()
    logz = float(m) + math.log(float(np.exp(row - m, dtype=np.float64).sum()))
    alts = tuple((int(t), float(row[t]) - logz) for t in _best_ids(row, top)) if top else ()
    return SampleResult(token, float(row[token]) - logz, alts)
