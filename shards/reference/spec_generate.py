"""Speculative generation over a chain of shard engines held in one process: the reference path for speculative
decoding (tests, benchmarks, the one-shot CLI), as shards/reference/generate.py is for plain decoding.

Each trip feeds [t, d1..dk] (the last emitted token and up to k proposals) through every shard in one pass, verifies
the k+1 rows (shards.decoding.speculation.verify) and rolls every shard's cache back to the accepted length, so the caches
always hold exactly the tokens emitted so far. The tokens are those `generate` yields for the same prompt and
seed (verify samples each row as plain sampling does), with fewer trips when proposals are accepted.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from shards.decoding.penalties import with_context
from shards.decoding.sampling import SampleResult, SamplerState, SamplingParams
from shards.decoding.speculation import DraftLength, Proposer, verify
from shards.engines.base import Engine
from shards.reference.generate import chain_forward


@dataclass
class SpeculationStats:
    """What one generation did: trips through the model, tokens emitted, drafts proposed and accepted."""

    trips: int = 0
    tokens: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def tokens_per_trip(self) -> float:
        return self.tokens / self.trips if self.trips else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def speculative_generate(
    engines: Sequence[Engine],
    prompt: Sequence[int],
    max_tokens: int,
    params: SamplingParams = SamplingParams(temperature=0.0),
    *,
    proposer: Proposer,
    length: DraftLength,
    eos_ids: frozenset[int] = frozenset(),
    stats: SpeculationStats | None = None,
    request_id: str | None = None,
) -> Iterator[SampleResult]:
    """Yield sampled tokens until eos (yielded too) or max_tokens, `length` deciding how many proposals each trip
    carries; frees every shard's cache and the proposer's state at the end (also when the caller stops early)."""
    rid = request_id or uuid.uuid4().hex
    stats = stats if stats is not None else SpeculationStats()
    params = with_context(params, list(prompt))  # penalties count the prompt's tail, as the entry node arranges
    state = SamplerState.from_seed(params.seed)
    context = min(e.config.max_position_embeddings for e in engines)
    sample = engines[-1].sample
    tokens = [int(t) for t in prompt]
    try:
        logits = chain_forward(engines, rid, np.asarray(tokens, dtype=np.int64))
        block = verify(logits, (), params, state, sample=sample)
        stats.trips += 1
        while True:
            for result in block[: max_tokens - stats.tokens]:
                stats.tokens += 1
                tokens.append(result.token)
                yield result
                if result.token in eos_ids:
                    return
            if stats.tokens >= max_tokens or len(tokens) >= context:
                return
            # the cache holds every token but the last; the trip feeds it and at most k proposals, never more
            # than the tokens still wanted (the bonus token comes free) or the context holds
            room = min(max_tokens - stats.tokens - 1, context - len(tokens))
            drafts = proposer.propose(rid, tokens, min(length.next(), room))[:room]
            start = len(tokens) - 1
            chunk = np.asarray([tokens[-1], *drafts], dtype=np.int64)
            logits = chain_forward(engines, rid, chunk, all_logits=True)
            block = verify(logits, drafts, params, state, sample=sample)
            accepted = len(block) - 1
            stats.trips += 1
            stats.proposed += len(drafts)
            stats.accepted += accepted
            length.update(len(drafts), accepted)
            for engine in engines:  # keep t and the accepted drafts; the rejected ones are rewritten next trip
                engine.rollback(rid, start + 1 + accepted)
    finally:
        proposer.release(rid)
        for engine in engines:
            engine.release(rid)
