"""Finished requests' KV caches kept for reuse by later requests that start with the same tokens.

A cache holds, for each position, keys and values that depend only on the tokens up to that position (the block
is causal), so a new request whose first k tokens are those of a finished one can take its cache over, truncated
to k positions, and compute only the rest. Which request matches is the caller's to know (the token index,
node/core/prefix_cache.py, lives on the entry node; other nodes never see tokens); this store only holds caches by
id, least recently used first out, within a byte limit.

Why truncating is exact: every engine writes a step's positions at [start, start + n) and attends only to the
first start + n cells (numpy/MLX slabs slice them; ggml masks every cell past a row's position with -inf, and the
stale cells it skips hold finite values a validated step wrote, so their weight is exactly 0). Positions past k are
overwritten before anything reads them.

Every cache leaves the store exactly once: taken by a request (which then owns and frees it), or freed here when
evicted, cleared, or kept past the limit.
"""

from __future__ import annotations

from collections import OrderedDict

from shards.engines.backend import RequestCache


class RetainedCaches:
    """Caches of finished requests by id, LRU, within `limit` bytes (0 keeps nothing)."""

    def __init__(self, limit: int = 0):
        if limit < 0:
            raise ValueError("a retained-cache limit is a number of bytes >= 0")
        self.limit = limit
        self.caches: OrderedDict[str, RequestCache] = OrderedDict()  # least recently used first
        self.evictions = 0
        self.copies = 0  # partial hits served by copying a prefix

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in list(self.caches.values()))

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self.caches

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

    def take(self, entry_id: str, positions: int) -> RequestCache | None:
        """A cache of the retained one's first `positions` positions, owned by the caller; None when it was evicted
        (the caller then computes every position). All of it: the cache itself, which leaves the store (the caller
        extends it: a conversation's next turn). Part of it: a copy, and the retained cache stays, most recently
        used (a side request sharing only a preamble must not consume a conversation's cache). Storage that can't
        copy hands the cache itself over, truncated. node/core/prefix_cache.py applies the same rule to its index."""
        cache = self.caches.get(entry_id)
        if cache is None or not 1 <= positions <= cache.length:
            return None
        if positions < cache.length:
            try:
                copy = cache.copy_prefix(positions)
            except NotImplementedError:
                pass
            else:
                self.caches.move_to_end(entry_id)
                self.copies += 1
                return copy
        del self.caches[entry_id]
        cache.truncate(positions)
        return cache

    def shrink(self, limit: int) -> list[str]:
        """Free least recently used caches until at most `limit` bytes remain (admission calls this before it
        refuses a request for room); the ids freed."""
        freed, total = [], self.nbytes
        while self.caches and total > limit:
            entry_id, cache = self.caches.popitem(last=False)
            total -= cache.nbytes
            cache.free()
            freed.append(entry_id)
            self.evictions += 1
        return freed

    def drop(self, entry_id: str) -> bool:
        """Free one retained cache (its index entry went away); True if it was held."""
        cache = self.caches.pop(entry_id, None)
        if cache is not None:
            cache.free()
        return cache is not None

    def clear(self) -> None:
        for cache in self.caches.values():
            cache.free()
        self.caches.clear()


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
