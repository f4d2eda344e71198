"""Which finished requests' KV caches a node still holds, by the tokens they hold: the longest-prefix lookup that
lets a new request prefill only what no earlier request already computed.

Chat clients resend the whole conversation every turn, agents resend the same tool definitions, and many requests
share a system prompt; the KV of those positions is the same whatever request computed it (the block is causal: a
position's keys and values depend on the tokens up to it and nothing else). So when a request ends, its cache can
be kept under its id (the engine's `RetainedCaches`, shards/engines/retained.py) and its tokens recorded here; a
later request whose tokens start with k of them starts from those k positions of its cache, and prefills
only tokens[k:].

Invariants:
- An entry's tokens are exactly the positions its cache holds, in order (the prompt and every generated token the
  cache took), so a prefix match is a match of cached positions.
- A hit never covers a whole prompt: at least one token is left to compute, since the next token's logits come from
  the last position's forward pass.
- Entries form a tree: an entry shares its first whole blocks with the entry it branches from, and the nodes hold
  only its positions past them (shards/engines/retained.py, told by the entry through EndRequest). So a chat
  template's preamble, or a conversation's earlier turns, is held once for every request that shares it.
- The index is bounded (`capacity` positions held over all entries, and `max_entries`); leaves leave least
  recently used first (an entry outlives its branches); `add` and `evict` say which ids left, so the caller frees
  exactly those caches.
- A hit on a whole leaf takes it out: the request takes that cache over and extends it (a conversation's next
  turn), and is added again under its own id with its longer tokens when it finishes. Any other hit leaves the
  entry in, most recently used: every node copies the chain's positions into the request's own cache (the same
  rule), so a side request sharing only a preamble never consumes a conversation's cache, and a shared preamble
  serves every client.

Pure: no engine, no clock, no I/O; the runtime keeps the index and the engine's retained caches in step.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shards.engines import lru_tree as tree


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


BLOCK = 16  # a branch shares whole blocks of its parent's positions (vLLM's block size): a few positions past the
# last shared block are held twice, and in return a branch never starts inside a block another branch starts in


class PrefixIndex:
    """Finished requests' token sequences whose caches are retained, as a tree (see the module docstring)."""

    def __init__(self, capacity: int, max_entries: int = 64, min_tokens: int = 1):
        if capacity < 0 or max_entries < 1 or min_tokens < 1:
            raise ValueError("a prefix index needs capacity >= 0, max_entries >= 1 and min_tokens >= 1")
        self.capacity, self.max_entries, self.min_tokens = capacity, max_entries, min_tokens
        self.entries: OrderedDict[str, np.ndarray] = OrderedDict()  # least recently used first
        self.scopes: dict[str, str] = {}  # entry id -> the scope it was added in (a plan: nodes and layers)
        self.parents: dict[str, tuple[str, int]] = {}  # a branch -> (its parent, the positions it shares with it)
        self.children: Counter[str] = Counter()
        self.positions = 0  # what the nodes hold: each entry's positions past its parent's
        self.hits = self.hit_tokens = self.misses = self.evictions = self.partial_hits = 0

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry_id: str, tokens: Sequence[int] | np.ndarray, scope: str = "") -> list[str]:
        """Record that `entry_id`'s cache, holding exactly `tokens`, is retained (by the nodes and layers `scope`
        names: only a lookup in the same scope finds it), as a branch of the entry it shares the most whole blocks
        with (`branch_of` says which: the nodes are told to hold only the rest). Returns the ids evicted to make room
        (least recently used leaves first), `entry_id` itself when it could never fit: the caller frees those."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1:
            raise ValueError("an entry's tokens are one sequence")
        if entry_id in self.entries:
            raise ValueError(f"entry {entry_id!r} is already indexed")
        parent, shared, depth = "", 0, 0  # the most shared blocks; of those, in the fewest pieces (an ancestor)
        for other, held in self.entries.items():
            n = min(common_prefix(held, tokens), len(tokens) - 1) // BLOCK * BLOCK
            base = self.parents.get(other, ("", 0))[1]
            if self.scopes[other] == scope and (n > shared or (n == shared and n and base < depth)):
                parent, shared, depth = other, n, base
        if len(tokens) < self.min_tokens or len(tokens) - shared > self.capacity:
            return [entry_id]
        self.entries[entry_id] = tokens
        self.scopes[entry_id] = scope
        self.positions += len(tokens) - shared
        if parent:
            tree.link(self.parents, self.children, entry_id, parent, shared)
            tree.touch(self.entries, self.parents, entry_id)
        evicted = []
        while self.positions > self.capacity or len(self.entries) > self.max_entries:
            evicted.append(self._pop_oldest())
        return evicted

    def branch_of(self, entry_id: str) -> tuple[str, int] | None:
        """(the entry it is a branch of, the positions they share), or None for a root."""
        return self.parents.get(entry_id)

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
        """A new request starts from the hit: it takes a whole leaf over (the entry leaves the index) or copies
        (the entry stays, with its ancestors, most recently used). The hit is counted."""
        tokens = self.entries[hit.entry_id]
        if hit.tokens > len(tokens):
            raise ValueError(f"entry {hit.entry_id!r} holds {len(tokens)} positions, not {hit.tokens}")
        if hit.tokens == len(tokens) and not self.children[hit.entry_id]:
            self.remove(hit.entry_id)
        else:
            tree.touch(self.entries, self.parents, hit.entry_id)
            self.partial_hits += 1
        self.hits += 1
        self.hit_tokens += hit.tokens

    def remove(self, entry_id: str) -> bool:
        """Forget an entry whose cache is gone (a node evicted it), and its branches (they need it); True if it
        was indexed."""
        if entry_id not in self.entries:
            return False
        for child in tree.branches(self.parents, entry_id):
            self.remove(child)
        self._forget(entry_id)
        return True

    def evict(self) -> str | None:
        """Make room: the least recently used leaf leaves; its id, or None when the index is empty."""
        return self._pop_oldest() if self.entries else None

    def _pop_oldest(self) -> str:
        entry_id = tree.oldest_leaf(self.entries, self.children)
        self._forget(entry_id)
        self.evictions += 1
        return entry_id

    def _forget(self, entry_id: str) -> None:
        tokens = self.entries.pop(entry_id)
        del self.scopes[entry_id]
        self.positions -= len(tokens) - tree.unlink(self.parents, self.children, entry_id)
