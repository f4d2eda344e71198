"""Generation over a chain of shard engines held in one process (reference path, tests, one-shot CLI)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence

import numpy as np

from shards.decoding.penalties import with_context
from shards.decoding.sampling import SampleResult, SamplerState, SamplingParams
from shards.engines.base import Engine, StepInput


def chain_forward(
    engines: Sequence[Engine], request_id: str, tokens: np.ndarray, all_logits: bool = False
) -> np.ndarray:
    """Run `tokens` through every shard in order; returns the last shard's logits."""
    out: np.ndarray | None = None
    for i, engine in enumerate(engines):
        item = StepInput(request_id, tokens=tokens) if i == 0 else StepInput(request_id, hidden=out)
        out = engine.forward([item], all_logits=all_logits)[0]
    return out


def generate(
    engines: Sequence[Engine],
    prompt: Sequence[int],
    max_tokens: int,
    params: SamplingParams = SamplingParams(temperature=0.0),
    eos_ids: frozenset[int] = frozenset(),
) -> Iterator[SampleResult]:
    """Yield sampled tokens until eos (yielded too) or max_tokens; frees every shard's cache at the end. Penalties
    count the prompt's tail, as the entry node arranges (`with_context`)."""
    request_id = uuid.uuid4().hex
    params = with_context(params, list(prompt))
    state = SamplerState.from_seed(params.seed)
    tokens = np.asarray(prompt, dtype=np.int64)
    try:
        for _ in range(max_tokens):
            logits = chain_forward(engines, request_id, tokens)
            result = engines[-1].sample(logits, [params], [state])[0]
            yield result
            if result.token in eos_ids:
                return
            tokens = np.array([result.token], dtype=np.int64)
    finally:
        for engine in engines:
            engine.release(request_id)
