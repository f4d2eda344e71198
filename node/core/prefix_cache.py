"""Which finished requests' KV caches a node still holds, by the tokens they hold: the longest-prefix lookup that
lets a new request prefill only what no earlier request already computed.

Chat clients resend the whole conversation every turn, agents resend the same tool definitions, and many requests
share a system prompt; the KV of those positions is the same whatever request computed it (the block is causal: a
position's keys and values depend on the tokens up to it and nothing else). So when a request ends, its cache can
be kept under its id (the engine's `RetainedCaches`, shards/engines/retained.py) and its tokens recorded here; a
later request whose tokens start with k of them takes that cache over, truncated to k positions, and prefills
only tokens[k:].

Invariants:
- An entry's tokens are exactly the positions its cache holds, in order (the prompt and every generated token the
  cache took), so a prefix match is a match of cached positions.
- A hit never covers a whole prompt: at least one token is left to compute, since the next token's logits come from
  the last position's forward pass.
- The index is bounded (`capacity` positions over all entries, and `max_entries`), least recently used first out;
  `add` and `evict` say which ids left, so the caller frees exactly those caches.
- A hit on a whole entry takes it out: the request takes that cache over and extends it (a conversation's next
  turn), and is added again under its own id with its longer tokens when it finishes. A hit on part of an entry
  leaves it in, most recently used: every node copies that part into the request's own cache
  (shards/engines/retained.py, the same rule), so a side request sharing only a preamble never consumes a
  conversation's cache, and a shared preamble serves every client.

Pure: no engine, no clock, no I/O; the runtime keeps the index and the engine's retained caches in step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PrefixHit:
    """Reuse `tokens` positions of the cache retained under `entry_id`."""

    entry_id: str
    tokens: int

    def __post_init__(self):
        if not self.entry_id or self.tokens < 1:
            raise ValueError("a prefix hit names an entry and reuses at least one position")


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two sequences share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixIndex:
    """Finished requests' token sequences whose caches are retained (see the module docstring)."""

    def __init__(self, capacity: int, max_entries: int = 64, min_tokens: int = 1):
        if capacity < 0 or max_entries < 1 or min_tokens < 1:
            raise ValueError("a prefix index needs capacity >= 0, max_entries >= 1 and min_tokens >= 1")
        self.capacity, self.max_entries, self.min_tokens = capacity, max_entries, min_tokens
        self.entries: OrderedDict[str, np.ndarray] = OrderedDict()  # least recently used first
        self.scopes: dict[str, str] = {}  # entry id -> the scope it was added in (a plan: nodes and layers)
        self.positions = 0
        self.hits = self.hit_tokens = self.misses = self.evictions = self.partial_hits = 0

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry_id: str, tokens: Sequence[int] | np.ndarray, scope: str = "") -> list[str]:
        """Record that `entry_id`'s cache, holding exactly `tokens`, is retained (by the nodes and layers `scope`
        names: only a lookup in the same scope finds it). Returns the ids evicted to make room (least recently used
        first), `entry_id` itself when it could never fit: the caller frees those."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1:
            raise ValueError("an entry's tokens are one sequence")
        if entry_id in self.entries:
            raise ValueError(f"entry {entry_id!r} is already indexed")
        if len(tokens) < self.min_tokens or len(tokens) > self.capacity:
            return [entry_id]
        self.entries[entry_id] = tokens
        self.scopes[entry_id] = scope
        self.positions += len(tokens)
        evicted = []
        while self.positions > self.capacity or len(self.entries) > self.max_entries:
            evicted.append(self._pop_oldest())
        return evicted

    def longest(self, tokens: Sequence[int] | np.ndarray, scope: str = "") -> PrefixHit | None:
        """The entry sharing the longest prefix with a new prompt (at most len(tokens) - 1 positions, at least
        `min_tokens`), or None. Looking up does not take the entry: `take` does, once the caller has the cache."""
        tokens = np.asarray(tokens, dtype=np.int64)
        best: PrefixHit | None = None
        for entry_id, held in self.entries.items():
            if self.scopes[entry_id] != scope:
                continue
            n = min(common_prefix(held, tokens), len(tokens) - 1)
            if n >= self.min_tokens and (best is None or n > best.tokens):
                best = PrefixHit(entry_id, n)
        if best is None:
            self.misses += 1
        return best

    def take(self, hit: PrefixHit) -> None:
        """A new request starts from the hit: it takes a whole entry over (the entry leaves the index) or copies part
        of one (the entry stays, most recently used). The hit is counted."""
        tokens = self.entries[hit.entry_id]
        if hit.tokens > len(tokens):
            raise ValueError(f"entry {hit.entry_id!r} holds {len(tokens)} positions, not {hit.tokens}")
        if hit.tokens == len(tokens):
            self.remove(hit.entry_id)
        else:
            self.entries.move_to_end(hit.entry_id)
            self.partial_hits += 1
        self.hits += 1
        self.hit_tokens += hit.tokens

    def remove(self, entry_id: str) -> bool:
        """Forget an entry whose cache is gone (the engine evicted it for room); True if it was indexed."""
        tokens = self.entries.pop(entry_id, None)
        if tokens is None:
            return False
        del self.scopes[entry_id]
        self.positions -= len(tokens)
        return True

    def evict(self) -> str | None:
        """Make room: the least recently used entry leaves; its id, or None when the index is empty."""
        return self._pop_oldest() if self.entries else None

    def _pop_oldest(self) -> str:
        entry_id, tokens = self.entries.popitem(last=False)
        del self.scopes[entry_id]
        self.positions -= len(tokens)
        self.evictions += 1
        return entry_id
