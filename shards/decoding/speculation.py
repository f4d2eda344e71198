"""Speculative decoding, the pure pieces: where proposals come from, how many to make, and how to accept them.

A *proposal* is a few tokens guessed to follow a request's text (`Proposal`, point-mass drafts: no draft
distribution travels). The pipeline runs them through the target model as one short chunk, so the last node gets
the logits of the rows [t, d1..dk] in one trip, and `verify` turns those into the tokens to emit: the accepted
drafts plus one more token, 1..k+1 tokens per trip instead of 1.

Exactness. `verify` samples each row exactly as non-speculative sampling would (`shards.decoding.sampling.sample_rows`: the
same filters, the same one uniform per sampled token from the request's `SamplerState`), in order, and stops at
the first row whose sampled token differs from the draft: that token is emitted in its place. Row i's logits are
the target's logits after the accepted prefix, so every emitted token is drawn from exactly the distribution
non-speculative decoding would draw it from; with the same seed the very same tokens come out. This *is* the
speculative-sampling rule for point-mass drafts (accept d_i with probability min(1, p(d_i)/q(d_i)) = p(d_i); on
rejection draw from max(0, p - q) renormalised, which is p with d_i removed): drawing t ~ p and accepting when
t == d_i accepts with probability p(d_i), and given a rejection t is distributed as p restricted to t != d_i.
See docs/speculative-decoding.md.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from shards.decoding.sampling import SampleResult, SamplerState, SamplingParams, sample_rows

Proposal = tuple[int, ...]

RowSampler = Callable[[np.ndarray, list[SamplingParams], list[SamplerState]], list[SampleResult]]


class Proposer(Protocol):
    """A source of drafts for the requests of one entry node."""

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> Proposal:
        """At most `k` tokens guessed to follow `tokens` (the prompt plus every token accepted so far); may be
        empty. `tokens` normally extends the previous call's; a proposer must also be right when it does not."""
        ...

    def release(self, request_id: str) -> None:
        """Free everything kept for the request (idempotent; unknown ids are ignored)."""
        ...


class PromptLookup:
    """Drafts by n-gram lookup in the request's own tokens (no model): find the most recent earlier occurrence
    of the longest suffix of `tokens` of length max_ngram..min_ngram, and propose what followed it. Code edits,
    summaries, RAG answers and JSON repeat their input, so the continuation is often right.

    Invariant: for each request, `_Index.latest[n][g]` is the start of the most recent occurrence of the n-gram g
    in tokens[:length] that is followed by at least one token (start + n < length). The index is extended
    incrementally as `tokens` grows (O(new tokens) per call), rebuilt when `tokens` no longer extends what was
    indexed (a replay, a rollback). An index costs a few hundred bytes per token: at
    most `max_requests` indexes and `max_tokens` indexed tokens are kept in all (the least recently used evicted
    first, never the one being asked for: an evicted request is just re-indexed at its next call), so memory stays
    bounded however many requests run or miss their release.
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, *, max_requests: int = 256, max_tokens: int = 1 << 19):
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram!r} max_ngram={max_ngram!r}")
        for name, value in (("max_requests", max_requests), ("max_tokens", max_tokens)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self._indexes: OrderedDict[str, _Index] = OrderedDict()
        self._tokens = 0  # indexed tokens over every request
        self._lock = threading.Lock()  # a followed request is asked on the engine thread, the others on the loop

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> Proposal:
        if not (isinstance(k, int) and k >= 0):
            raise ValueError(f"k must be an integer >= 0, got {k!r}")
        with self._lock:
            return self._propose(request_id, tokens, k)

    def _propose(self, request_id: str, tokens: Sequence[int], k: int) -> Proposal:
        index = self._indexes.get(request_id)
        if index is None or not index.extended_by(tokens):
            if index is not None:
                self._tokens -= len(self._indexes.pop(request_id).tokens)
            index = self._indexes[request_id] = _Index(self.min_ngram, self.max_ngram)
        self._indexes.move_to_end(request_id)
        self._tokens += index.extend(tokens)
        while len(self._indexes) > 1 and (len(self._indexes) > self.max_requests or self._tokens > self.max_tokens):
            self._tokens -= len(self._indexes.popitem(last=False)[1].tokens)
        if k == 0:
            return ()
        seq = index.tokens
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            start = index.latest[n].get(tuple(seq[len(seq) - n :]))
            if start is not None:
                return tuple(seq[start + n : start + n + k])
        return ()

    def release(self, request_id: str) -> None:
        with self._lock:
            index = self._indexes.pop(request_id, None)
            if index is not None:
                self._tokens -= len(index.tokens)

    def __len__(self) -> int:
        """How many requests have an index (for tests and metrics)."""
        return len(self._indexes)

    @property
    def indexed_tokens(self) -> int:
        """Tokens indexed over every request (what memory grows with)."""
        return self._tokens


class _Index:
    """One request's n-gram index (see PromptLookup's invariant)."""

    __slots__ = ("tokens", "latest", "_min", "_max")

    def __init__(self, min_ngram: int, max_ngram: int):
        self.tokens: list[int] = []
        self._min, self._max = min_ngram, max_ngram
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}

    def extended_by(self, tokens: Sequence[int]) -> bool:
        """Whether `tokens` starts with every indexed token (one C-level comparison)."""
        have = len(self.tokens)
        if len(tokens) < have:
            return False
        head = tokens[:have]
        head = head.tolist() if isinstance(head, np.ndarray) else head if isinstance(head, list) else list(head)
        return head == self.tokens

    def extend(self, tokens: Sequence[int]) -> int:
        """Index the tokens past those indexed; returns how many were added."""
        old = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens[old:])
        seq, new = self.tokens, len(self.tokens)
        for n in range(self._min, self._max + 1):
            table = self.latest[n]
            # starts newly followed by a token: old - n <= s <= new - n - 1 (in increasing order: latest wins)
            for s in range(max(0, old - n), new - n):
                table[tuple(seq[s : s + n])] = s
        return new - old


RATE_WEIGHT = 0.3  # how far one trip moves a request's acceptance rate (DraftLength.rate)


class DraftLength:
    """How many tokens to propose next for one request, adapted to how many were accepted and to what a draft row
    costs where it is verified.

    Grows by one after a fully accepted proposal, shrinks to one more than the accepted count after a partial one.
    After `patience` proposals in a row with nothing accepted it pauses (next() returns 0) for `backoff` calls,
    then tries again with one token; each further failed retry doubles the pause (up to `max_backoff`), and any
    acceptance ends the back-off. So a request whose text never repeats costs almost no verification work, and
    one that starts repeating later (a quoted passage) is found again within max_backoff steps.

    `row_cost`: what a draft row adds to a step, as a share of a one-row step (node/runtime/calibration.py
    `draft_row_cost`). An accepted draft saves a step; a proposed one costs `row_cost` of one. So proposals pay
    while the share of them accepted (`rate`, over recent trips, starting from `rate`: the node's recent requests')
    is above `row_cost`; a trip that leaves it at or below pauses as a failure does, and a request whose start
    says so begins paused. At 0 (a step's time is reading its weights: drafts ride free) only failures pause.
    """

    def __init__(
        self,
        max_tokens: int,
        *,
        patience: int = 3,
        backoff: int = 4,
        max_backoff: int = 64,
        row_cost: float = 0.0,
        rate: float = 1.0,
    ):
        for name, value, low in (("max_tokens", max_tokens, 0), ("patience", patience, 1), ("backoff", backoff, 1)):
            if not (isinstance(value, int) and value >= low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not (isinstance(max_backoff, int) and max_backoff >= backoff):
            raise ValueError(f"max_backoff must be an integer >= backoff ({backoff}), got {max_backoff!r}")
        if not (isinstance(row_cost, (int, float)) and 0 <= row_cost < float("inf")):
            raise ValueError(f"row_cost must be a finite share >= 0, got {row_cost!r}")
        if not (isinstance(rate, (int, float)) and 0 <= rate <= 1):
            raise ValueError(f"rate must be a share in [0, 1], got {rate!r}")
        self.max_tokens, self.patience, self.min_backoff, self.max_backoff = max_tokens, patience, backoff, max_backoff
        self.row_cost = float(row_cost)
        self.length = min(max_tokens, 2)
        self.rate = float(rate)  # accepted / proposed, averaged over recent trips (RATE_WEIGHT each)
        self._misses = 0  # proposals in a row with nothing accepted
        self._backoff = backoff  # the next pause's length
        self._paused = 0  # calls of next() still to answer 0
        if not self._pays():
            self.length = 1
            self._pause()

    def next(self) -> int:
        if self._paused:
            self._paused -= 1
            return 0
        return self.length

    def update(self, proposed: int, accepted: int) -> None:
        if not (isinstance(proposed, int) and isinstance(accepted, int) and 0 <= accepted <= proposed):
            raise ValueError(f"need 0 <= accepted <= proposed, got proposed={proposed!r} accepted={accepted!r}")
        if proposed == 0:
            return  # nothing was tried (a paused step, or the proposer had no match)
        self.rate += RATE_WEIGHT * (accepted / proposed - self.rate)
        if accepted == 0:
            self._misses += 1
            self.length = 1
            if self._misses >= self.patience:
                self._pause()
                self._misses = self.patience - 1  # one more failure after the pause pauses again, longer
            elif not self._pays():
                self._pause()
            return
        if not self._pays():
            self.length = 1  # accepted, but too few for what the drafts cost: retried after a pause, alone
            self._pause()
            return
        self._misses, self._backoff = 0, self.min_backoff
        grown = self.length + 1 if accepted == proposed else accepted + 1
        self.length = max(1, min(self.max_tokens, grown))

    def _pays(self) -> bool:
        return not self.row_cost or self.rate > self.row_cost

    def _pause(self) -> None:
        self._paused = self._backoff
        self._backoff = min(self.max_backoff, 2 * self._backoff)


def verify(
    logits: np.ndarray,
    drafts: Proposal,
    params: SamplingParams,
    state: SamplerState,
    top_logprobs: int | None = None,
    *,
    sample: RowSampler = sample_rows,
) -> list[SampleResult]:
    """The tokens to emit for one request's verified block: the accepted drafts plus one more (1..k+1 results).

    `logits` [k+1, vocab] are the target's rows for [t, d1..dk] (row i predicts the token after d_i). Row i is
    sampled with `sample` exactly as non-speculative decoding samples one row (by default shards.decoding.sampling's
    sample_rows, with params' temperature/top-k/top-p and logprobs; `top_logprobs`, when given, overrides
    params.top_logprobs); the block stops at the first sampled token that differs from its draft, which is
    emitted in the draft's place, else after the bonus token from the last row. Greedy: the longest prefix of
    drafts equal to the argmax, then the argmax after it. Draws: exactly one uniform from `state` per emitted
    token when sampling (none when greedy), the same count non-speculative decoding uses, so a replay's
    `SamplerState.from_seed(seed, skip=tokens sampled so far)` stays right. A grammar matcher in `state` masks
    each row before it is sampled and is advanced by each emitted token, exactly as the sampling batcher does.
    """
    return verify_blocks(logits, [drafts], [params], [state], top_logprobs=[top_logprobs], sample=sample)[0]


def verify_blocks(
    logits: np.ndarray,
    drafts: Sequence[Proposal],
    params: Sequence[SamplingParams],
    states: Sequence[SamplerState],
    *,
    top_logprobs: Sequence[int | None] | None = None,
    sample: RowSampler = sample_rows,
) -> list[list[SampleResult]]:
    """`verify` for several requests at once: `logits` stacks their blocks in order, len(drafts[j]) + 1 rows each.

    Position by position, the rows of every request still accepting are sampled in one `sample` call (rows are
    sampled independently of their batch, so each request's result is the same as alone)."""
    logits = np.asarray(logits, dtype=np.float32)
    n = len(drafts)
    tops = list(top_logprobs) if top_logprobs is not None else [None] * n
    if not (len(params) == len(states) == len(tops) == n):
        raise ValueError(f"{n} drafts, {len(params)} params, {len(states)} states, {len(tops)} top_logprobs")
    sizes = [len(d) + 1 for d in drafts]
    if logits.ndim != 2 or logits.shape[0] != sum(sizes):
        raise ValueError(f"logits {logits.shape} do not hold the {sum(sizes)} rows of blocks of sizes {sizes}")
    for p, s in zip(params, states):
        if p.constraint is not None and s.matcher is None:
            raise ValueError(
                "a constrained request's state has no grammar matcher: make it first (as the batcher does)"
            )
    starts = np.cumsum([0] + sizes[:-1]).tolist()
    ps = [p if t is None else dataclasses.replace(p, top_logprobs=t) for p, t in zip(params, tops)]
    out: list[list[SampleResult]] = [[] for _ in range(n)]
    live = list(range(n))
    for i in range(max(sizes, default=0)):
        if not live:
            break
        rows = np.stack([_masked(logits[starts[j] + i], states[j]) for j in live])
        results = sample(rows, [ps[j] for j in live], [states[j] for j in live])
        if len(results) != len(live):
            raise ValueError(f"the sampler returned {len(results)} results for {len(live)} rows")
        still = []
        for j, result in zip(live, results):
            out[j].append(result)
            if states[j].matcher is not None:
                states[j].matcher.advance(result.token)
            if i < len(drafts[j]) and result.token == drafts[j][i]:
                still.append(j)
        live = still
    return out


def _masked(row: np.ndarray, state: SamplerState) -> np.ndarray:
    return row if state.matcher is None else state.matcher.apply(row)
