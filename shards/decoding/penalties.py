"""Logit bias and repetition penalties: what a client's bias and a request's recent tokens do to its logits before
the sampler picks (greedy or drawn), as llama.cpp's logit-bias and penalties samplers do, in that order:

    logit[t] += bias[t]
    for each token t seen c > 0 times among the last `penalty_last_n` tokens (the prompt's tail, then the sampled):
        logit[t] = logit[t] * repeat if logit[t] <= 0 else logit[t] / repeat
        logit[t] -= c * frequency + presence

One window serves all three penalties, as llama-server applies OpenAI's presence and frequency penalties.

Invariant: a row's processed logits depend only on the raw row, the request's params and its window, and the
window is the last `penalty_last_n` tokens of (prompt + sampled tokens). So a replay elsewhere, whose prompt is the
original prompt plus the tokens already sampled, rebuilds the same window from its own prompt's tail
(`with_context`) and continues exactly; and a row's result is the same alone or in a batch (no cross-row terms).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

DEFAULT_WINDOW = 64  # llama.cpp's and Ollama's repeat_last_n
MAX_PENALTY_WINDOW = 4096  # tokens a window may hold (Ollama's repeat_last_n; llama.cpp's default is 64)
MAX_LOGIT_BIAS = 1024  # entries of a logit bias (OpenAI caps a request's at 300)
MAX_BIAS = 100.0  # |bias|: OpenAI's range; -100 bans a token, +100 all but forces it


def check(params) -> None:
    """The penalty and bias fields of a SamplingParams, validated (ValueError naming the field)."""
    for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r}")
    rep = params.repetition_penalty
    if isinstance(rep, bool) or not isinstance(rep, (int, float)) or not 0 < rep <= 10:
        raise ValueError(f"repetition_penalty must be a number in (0, 10], got {rep!r}")
    n = params.penalty_last_n
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_PENALTY_WINDOW:
        raise ValueError(f"penalty_last_n must be an integer in [0, {MAX_PENALTY_WINDOW}], got {n!r}")
    context = params.penalty_context
    if not isinstance(context, tuple) or len(context) > n:
        raise ValueError(f"penalty_context must be a tuple of at most penalty_last_n ({n}) token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in context):
        raise ValueError("penalty_context must hold token ids >= 0")
    bias = params.logit_bias
    if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias must be a tuple of at most {MAX_LOGIT_BIAS} (token id, bias) pairs")
    ids = [t for t, _ in bias]
    if ids != sorted(set(ids)):
        raise ValueError("logit_bias must list each token id once, in increasing order")
    for t, b in bias:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"logit_bias token ids must be integers >= 0, got {t!r}")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -MAX_BIAS <= b <= MAX_BIAS:
            raise ValueError(f"a logit bias must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {b!r}")


def penalizes(params) -> bool:
    """Whether the request's recent tokens change its logits (so its sampler keeps a window of them)."""
    active = params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1
    return active and params.penalty_last_n > 0


def with_context(params, tokens: Sequence[int]):
    """`params` with the window's start: the last `penalty_last_n` of `tokens` (a prompt, or a replay's prompt
    and the tokens sampled so far). Unchanged when nothing is penalized."""
    if not penalizes(params):
        return params
    tail = tuple(int(t) for t in tokens[max(0, len(tokens) - params.penalty_last_n) :])
    return dataclasses.replace(params, penalty_context=tail)


def apply(row: np.ndarray, params, window: Sequence[int]) -> np.ndarray:
    """The row [vocab] as the sampler sees it: a new float32 array, biased, then penalized over `window`."""
    out = np.array(row, dtype=np.float32)
    if params.logit_bias:
        ids = np.fromiter((t for t, _ in params.logit_bias), dtype=np.int64)
        if ids[-1] >= len(out):
            raise ValueError(f"logit_bias names token {int(ids[-1])}, past the vocabulary ({len(out)})")
        out[ids] += np.fromiter((b for _, b in params.logit_bias), dtype=np.float32)
    if penalizes(params) and len(window):
        ids, counts = np.unique(np.fromiter(window, dtype=np.int64), return_counts=True)
        if ids[-1] >= len(out):
            raise ValueError(f"a penalized token {int(ids[-1])} is past the vocabulary ({len(out)})")
        x, rep = out[ids], np.float32(params.repetition_penalty)
        x = np.where(x <= 0, x * rep, x / rep)
        # float32 throughout from float32 params: a node that got them over the wire (float32) computes the same
        x -= counts.astype(np.float32) * np.float32(params.frequency_penalty) + np.float32(params.presence_penalty)
        out[ids] = x
    return out


def lowers_only(params) -> bool:
    """Whether the bias and penalties can only lower a logit, never raise one: every bias <= 0, repetition_penalty
    >= 1, frequency and presence penalties >= 0 (as float32, as `apply` computes; each step's rounding is monotone,
    so a lowered value never rounds above the raw one). Such a row's best values after them are among its best raw
    values and those it lowered (shards/engines/picks.py `best_of`)."""
    if any(b > 0 for _, b in params.logit_bias):
        return False
    return not penalizes(params) or (
        params.repetition_penalty >= 1 and params.frequency_penalty >= 0 and params.presence_penalty >= 0
    )


def apply_at(ids: np.ndarray, values: np.ndarray, params, window: Sequence[int]) -> np.ndarray:
    """`apply` at some of a row's ids only: `values` are the row's values at `ids` (increasing). The same float32
    operations, element by element, as `apply` performs on the whole row, so the same numbers at those ids; ids the
    bias or the window name outside `ids` are not computed."""
    out = np.array(values, dtype=np.float32)
    if params.logit_bias:
        named = np.fromiter((t for t, _ in params.logit_bias), dtype=np.int64)
        at, here = _positions(ids, named)
        out[at] += np.fromiter((b for _, b in params.logit_bias), dtype=np.float32)[here]
    if penalizes(params) and len(window):
        named, counts = np.unique(np.fromiter(window, dtype=np.int64), return_counts=True)
        at, here = _positions(ids, named)
        x, rep = out[at], np.float32(params.repetition_penalty)
        x = np.where(x <= 0, x * rep, x / rep)
        lower = counts[here].astype(np.float32) * np.float32(params.frequency_penalty)
        x -= lower + np.float32(params.presence_penalty)
        out[at] = x
    return out


def _positions(ids: np.ndarray, named: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of `named` (increasing) that is among `ids` (increasing) lies in `ids`, and which of `named` those are."""
    at = np.minimum(np.searchsorted(ids, named), len(ids) - 1)
    here = ids[at] == named
    return at[here], here
