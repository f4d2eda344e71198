"""The tree both prefix stores keep: the entry's index of retained tokens (node/core/prefix_cache.py) and every node's
retained caches (shards/engines/retained.py). Each keeps its entries in an OrderedDict, least recently used first,
and its branches as `parents` (a branch -> its parent and the positions they share) with `children` counts; these
functions are the rules over them, written once:
- a parent outlives its branches, so room is made at the leaves, least recently used first;
- using an entry uses its ancestors too (they are part of what it holds);
- an entry that goes takes its branches with it (they hold nothing without it).
"""

from __future__ import annotations

from collections import Counter, OrderedDict

Parents = dict[str, tuple[str, int]]


def link(parents: Parents, children: Counter[str], entry: str, parent: str, at: int) -> None:
    parents[entry] = (parent, at)
    children[parent] += 1


def unlink(parents: Parents, children: Counter[str], entry: str) -> int:
    """Take a leaf out of the tree; the positions it shared with its parent (0 for a root)."""
    parent, at = parents.pop(entry, ("", 0))
    if parent:
        children[parent] -= 1
        if not children[parent]:
            del children[parent]
    return at


def touch(order: OrderedDict, parents: Parents, entry: str) -> None:
    """The entry and its ancestors, most recently used: the entry last."""
    chain = []
    while entry:
        chain.append(entry)
        entry = parents.get(entry, ("", 0))[0]
    for e in reversed(chain):
        order.move_to_end(e)


def oldest_leaf(order: OrderedDict, children: Counter[str]) -> str:
    """The least recently used entry without branches (a non-empty tree has one)."""
    return next(e for e in order if not children[e])


def branches(parents: Parents, entry: str) -> list[str]:
    """The entries that branch from `entry` directly."""
    return [c for c, (p, _) in parents.items() if p == entry]
