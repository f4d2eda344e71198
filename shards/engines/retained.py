"""Finished requests' KV caches kept for reuse by later requests that start with the same tokens, held as a tree so a
prefix many requests share is held once.

A cache holds, for each position, keys and values that depend only on the tokens up to that position (the block
is causal), so a new request whose first k tokens are those of a finished one can start from k positions of its
cache and compute only the rest. Which request matches is the caller's to know (the token index,
node/core/prefix_cache.py, lives on the entry node; other nodes never see tokens); this store holds caches by id,
within a byte limit.

The tree: a finished request is kept whole (`keep`), and the entry node, which knows its tokens, may then say that
its first `at` positions are those of another retained request's chain (`branch`): the store keeps only its
positions from `at` on, as a child of that one. A chat template's preamble, or a conversation's earlier turns, is
then held once for every request that shares it (RadixAttention's tree, at the granularity the entry node picks).
A request resuming from a branch gets one cache of its own: the chain's pieces, root first, copied into it.

Invariants:
- An entry's positions are its parent chain's first `at` positions, then its own; a parent is held while it has
  children, so every chain is whole. Eviction takes leaves, least recently used first.
- Every cache leaves the store exactly once: taken by a request (which then owns and frees it), or freed here when
  evicted, dropped, cleared, kept past the limit, or replaced by its branch.

Why copying is exact: every engine writes a step's positions at [start, start + n) and attends only to the first
start + n cells (numpy/MLX slabs slice them; ggml masks every cell past a row's position with -inf, and the stale
cells it skips hold finite values a validated step wrote, so their weight is exactly 0); a copy holds the same
keys and values at the same positions.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from shards.engines import lru_tree as tree
from shards.engines.backend import RequestCache


class RetainedCaches:
    """Caches of finished requests by id, as a tree of branches (see the module docstring), within `limit` bytes (0
    keeps nothing)."""

    def __init__(self, limit: int = 0):
        if limit < 0:
            raise ValueError("a retained-cache limit is a number of bytes >= 0")
        self.limit = limit
        self.caches: OrderedDict[str, RequestCache] = OrderedDict()  # least recently used first
        self.parents: dict[str, tuple[str, int]] = {}  # a branch -> (its parent, the positions it shares with it)
        self.children: Counter[str] = Counter()
        self.evictions = 0
        self.copies = 0  # hits served by copying (part of a cache, or a chain of branches)
        self.branches = 0  # caches made branches of another so far

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in list(self.caches.values()))

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self.caches

    def length(self, entry_id: str) -> int:
        """Positions the entry's whole chain holds."""
        return self.parents.get(entry_id, ("", 0))[1] + self.caches[entry_id].length

    def keep(self, entry_id: str, cache: RequestCache) -> list[str]:
        """Hold a finished request's cache. Returns the ids evicted (freed) to stay within the limit, `entry_id`
        itself when it could not be kept."""
        if entry_id in self.caches:
            cache.free()
            raise ValueError(f"a cache is already retained as {entry_id!r}")
        if cache.length < 1 or cache.nbytes > self.limit:
            cache.free()
            return [entry_id]
        self.caches[entry_id] = cache
        return self.shrink(self.limit)

    def branch(self, entry_id: str, parent: str, at: int) -> bool:
        """Hold only the entry's positions from `at` on, after the first `at` positions of `parent`'s chain (the
        entry node found their tokens the same). False, and nothing changed, where either is not held, the entry is
        already a branch or has branches, `at` is not inside both, or the storage can't copy."""
        cache = self.caches.get(entry_id)
        if cache is None or parent not in self.caches or entry_id == parent:
            return False
        if entry_id in self.parents or self.children[entry_id] or not 1 <= at < cache.length:
            return False
        if at > self.length(parent):
            return False
        try:
            own = cache.copy_span(at, cache.length)
        except NotImplementedError:
            return False
        cache.free()
        self.caches[entry_id] = own
        tree.link(self.parents, self.children, entry_id, parent, at)
        self.branches += 1
        tree.touch(self.caches, self.parents, entry_id)
        return True

    def take(self, entry_id: str, positions: int) -> RequestCache | None:
        """A cache of the entry's chain's first `positions` positions, owned by the caller; None when it was
        evicted (the caller then computes every position). A whole leaf leaves the store (a conversation's next
        turn extends it): a root is handed over as it is, a branch's chain copied. Anything else is copied and
        stays, most recently used (a side request sharing only a preamble must not consume a conversation's cache).
        Storage that can't copy hands a root over, truncated. node/core/prefix_cache.py applies the same rule."""
        if entry_id not in self.caches or not 1 <= positions <= self.length(entry_id):
            return None
        pieces = self._chain(entry_id, positions)
        whole_leaf = positions == self.length(entry_id) and not self.children[entry_id]
        if whole_leaf and entry_id not in self.parents:
            return self._pop(entry_id)
        cache = None
        try:
            first, n = pieces[0]
            cache = self.caches[first].copy_prefix(n, room=positions)
            for piece, n in pieces[1:]:
                cache.append_from(self.caches[piece], n)
        except NotImplementedError:
            if cache is not None:
                cache.free()
            if len(pieces) > 1 or self.children[entry_id]:
                return None
            cache = self._pop(entry_id)
            cache.truncate(positions)
            return cache
        self.copies += 1
        if whole_leaf:
            self._pop(entry_id).free()
        else:
            tree.touch(self.caches, self.parents, entry_id)
        return cache

    def shrink(self, limit: int) -> list[str]:
        """Free least recently used leaves until at most `limit` bytes remain (admission calls this before it
        refuses a request for room); the ids freed."""
        freed, total = [], self.nbytes
        while self.caches and total > limit:
            entry_id = tree.oldest_leaf(self.caches, self.children)
            cache = self._pop(entry_id)
            total -= cache.nbytes
            cache.free()
            freed.append(entry_id)
            self.evictions += 1
        return freed

    def drop(self, entry_id: str) -> bool:
        """Free one retained cache and its branches (its index entry went away); True if it was held."""
        if entry_id not in self.caches:
            return False
        for child in tree.branches(self.parents, entry_id):
            self.drop(child)
        self._pop(entry_id).free()
        return True

    def clear(self) -> None:
        for cache in self.caches.values():
            cache.free()
        self.caches.clear()
        self.parents.clear()
        self.children.clear()

    def _chain(self, entry_id: str, positions: int) -> list[tuple[str, int]]:
        """The pieces holding a chain's first `positions` positions, root first: (entry, its first n positions)."""
        pieces, end, at = [], positions, entry_id
        while at:
            parent, base = self.parents.get(at, ("", 0))
            if end > base:
                pieces.append((at, end - base))
                end = base
            at = parent
        return pieces[::-1]

    def _pop(self, entry_id: str) -> RequestCache:
        """Take a leaf out of the tree (the caller frees or owns its cache)."""
        tree.unlink(self.parents, self.children, entry_id)
        return self.caches.pop(entry_id)


def resume_all(engines, request_id: str, entry_id: str, positions: int) -> bool:
    """Start `request_id` on every engine of a chain (`Engine`s, one per shard, in order) from the first
    `positions` positions retained as `entry_id`, or on none: if one engine no longer holds that cache, the others
    release what they took and the request computes every position (a prefix missing from one shard can't be
    used by any: each shard's input is the previous one's output)."""
    resumed = []
    for engine in engines:
        if not engine.resume(request_id, entry_id, positions):
            for done in resumed:
                done.release(request_id)
            for rest in engines:
                rest.retained.drop(entry_id)  # what is left of that entry is of no use either
            return False
        resumed.append(engine)
    return True
