"""Drafts from a small model with the served model's tokenizer (--draft-model), run whole on the node that
proposes (the first node of a request's plan).

For each request the draft model keeps its own KV cache of the tokens it has seen. A proposal rolls that cache back
to the longest common prefix with the request's tokens (the accepted drafts stay, the rejected ones go), feeds the
missing tokens (in chunks of at most `chunk` positions), then drafts greedily, one single-row pass per further
token. Greedy drafts are the point-mass proposals `shards.decoding.speculation.verify` accepts exactly, whatever the draft
model computes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shards.decoding.speculation import Proposal
from shards.engines.base import Engine, StepInput
from shards.engines.registry import engine_factory
from shards.formats.config import ModelConfig
from shards.formats.loader import load_config
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard


class DraftModelError(ValueError):
    """The draft model cannot draft for the served model (another vocabulary); the message says what to pass."""


class DraftModelProposer:
    """A `shards.decoding.speculation.Proposer` over a whole small model on one engine.

    Invariant: for each request r, `_seen[r]` is exactly the tokens whose positions the engine caches for r
    (engine.cache_length(r) == len(_seen[r])). At most `max_requests` requests keep a cache; the least recently
    used one is released to make room (it is re-fed from scratch at its next proposal), so the draft model's memory
    stays bounded even if a release is missed. Calls are serialised by a lock: the engine is not thread-safe.
    """

    chunk = 512  # the most positions of one request fed in one step (a long prompt is fed over several)

    def __init__(self, engine: Engine, *, max_requests: int = 16):
        if not (engine.shard.is_first and engine.shard.is_last):
            raise DraftModelError(f"a draft model runs whole on one engine, got the shard {engine.shard}")
        if not (isinstance(max_requests, int) and max_requests >= 1):
            raise ValueError(f"max_requests must be an integer >= 1, got {max_requests!r}")
        self.engine, self.max_requests = engine, max_requests
        self._seen: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        path: str | Path,
        target: ModelConfig,
        *,
        engine: str = "auto",
        target_tokenizer: Tokenizer | None = None,
        max_requests: int = 16,
        **options: Any,
    ) -> DraftModelProposer:
        """The draft model at `path` (a GGUF file or a Hugging Face folder) on `engine`, checked against the served
        model's config (and tokenizer, when given): the same vocabulary, or a DraftModelError naming both."""
        cfg = load_config(path)
        check_vocabulary(path, cfg, target, target_tokenizer)
        make = engine_factory(engine, Path(path), **options)
        return cls(make(Path(path), Shard.whole("draft", cfg.n_layers), cfg), max_requests=max_requests)

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> Proposal:
        """Up to `k` greedy tokens of the draft model after `tokens` (fewer near the end of its context)."""
        return self.propose_batch([(request_id, tokens, k)])[0]

    def propose_batch(self, items: Sequence[tuple[str, Sequence[int], int]]) -> list[Proposal]:
        """`propose` for several requests (distinct ids) at once: each draft pass advances all of them in one
        engine step (the catch-up chunks of different lengths together, then one row per request still drafting),
        so N requests cost max(k) passes, not N * k. At most max_requests are drafted (those already holding a
        cache first); the others get no proposals this time. If a step fails, every request drafted is released
        (its cache may hold part of the step) and the error is raised: the next proposals start afresh."""
        ids = [rid for rid, _, _ in items]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a request appears twice in one batch of proposals: {ids}")
        context = self.engine.config.max_position_embeddings
        wanted = []
        for rid, tokens, k in items:
            if not (isinstance(k, int) and k >= 0):
                raise ValueError(f"k must be an integer >= 0, got {k!r}")
            tokens = [int(t) for t in tokens]
            wanted.append((rid, tokens, min(k, context - len(tokens)) if tokens else 0))
        with self._lock:
            served = [w for w in wanted if w[2] > 0]
            if len(served) > self.max_requests:  # the rest get no proposals: those holding a cache first
                served = sorted(served, key=lambda w: w[0] not in self._seen)[: self.max_requests]
            try:
                return self._draft(served, {rid: () for rid, _, _ in wanted})
            except BaseException:
                for rid, _, _ in served:
                    self._release(rid)
                raise

    def prefill(self, request_id: str, tokens: Sequence[int]) -> None:
        """Feed `tokens` now (e.g. the prompt, while the served model computes its first token), so the first
        proposal only feeds what follows. Beyond the draft model's context: nothing is fed."""
        tokens = [int(t) for t in tokens]
        if not tokens or len(tokens) > self.engine.config.max_position_embeddings:
            return
        with self._lock:
            try:
                self._draft([(request_id, tokens, 0)], {})
            except BaseException:
                self._release(request_id)
                raise

    def release(self, request_id: str) -> None:
        with self._lock:
            self._release(request_id)

    def close(self) -> None:
        """Release every request and free the engine's caches (ggml's memory too) at once."""
        with self._lock:
            for rid in list(self._seen):
                self._release(rid)
            self.engine.close()

    def __len__(self) -> int:
        """How many requests hold a draft cache."""
        return len(self._seen)

    def _draft(self, items: list[tuple[str, list[int], int]], out: dict[str, Proposal]) -> list[Proposal]:
        """Bring each request's cache to its tokens and draft k tokens after them (k = 0: only feed them)."""
        feeds: dict[str, list[int]] = {}
        for rid, tokens, k in items:
            seen = self._seen.get(rid)
            if seen is None:
                seen = self._seen[rid] = []
            self._seen.move_to_end(rid)
            # keep the longest common prefix, but to draft feed at least the last token: its logits give the first
            keep = common_prefix(seen, tokens) if k == 0 else min(common_prefix(seen, tokens), len(tokens) - 1)
            self.engine.rollback(rid, keep)
            del seen[keep:]
            if tokens[keep:]:
                feeds[rid] = tokens[keep:]
        while len(self._seen) > self.max_requests:  # the least recently used: not of this batch, moved to the end
            self._release(next(iter(self._seen)))
        drafts: dict[str, list[int]] = {rid: [] for rid in feeds}
        limits = {rid: k for rid, _, k in items}
        while feeds:
            batch = [StepInput(rid, tokens=np.array(feed[: self.chunk], dtype=np.int64)) for rid, feed in feeds.items()]
            logits = self.engine.forward(batch)
            for (rid, feed), row in zip(list(feeds.items()), logits):
                self._seen[rid].extend(feed[: self.chunk])
                if len(feed) > self.chunk:
                    feeds[rid] = feed[self.chunk :]
                    continue
                if limits[rid]:
                    drafts[rid].append(int(np.argmax(row[-1])))  # the lowest id among equal maxima, as greedy
                if len(drafts[rid]) == limits[rid]:
                    del feeds[rid]
                    out[rid] = tuple(drafts[rid])
                else:
                    feeds[rid] = drafts[rid][-1:]
        return list(out.values())

    def _release(self, request_id: str) -> None:
        if self._seen.pop(request_id, None) is not None:
            self.engine.release(request_id)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of a and b."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def check_vocabulary(
    path: str | Path, draft: ModelConfig, target: ModelConfig, target_tokenizer: Tokenizer | None = None
) -> None:
    """Refuse a draft model whose token ids do not mean what the served model's do."""
    if draft.vocab_size != target.vocab_size:
        raise DraftModelError(
            f"draft model {path} has a vocabulary of {draft.vocab_size} tokens, the served model {target.vocab_size}: "
            "a draft model must use the served model's tokenizer (e.g. a smaller model of the same family)"
        )
    if target_tokenizer is None:
        return
    mine, theirs = Tokenizer.load(path).hf.get_vocab(), target_tokenizer.hf.get_vocab()
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
        raise DraftModelError(
            f"draft model {path} has another tokenizer than the served model ({len(mine)} vs {len(theirs)} tokens; "
            f"first differences {differ}): a draft model must use the served model's tokenizer"
        )
