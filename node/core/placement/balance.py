"""The split of layers over nodes of different speeds and memory: contiguous ranges, in node-id order, that make the
slowest stage as fast as it can be, within each node's memory.

The rule, for nodes in id order (the ring order: a pure function of the members, never of who started first):
- a stage's time is its layers' cost (each layer's parameters a token goes through: node/core/placement/
  layer_costs.py `layer_compute`) times its node's time per unit of cost (1 / its measured speed);
- the split minimises the slowest stage: with micro-batches every stage computes at once, so the ring's throughput
  is the slowest stage's;
- among splits with that slowest stage, the one with the least predicted time per token for one stream, the sum
  of the stages' compute + (N - 1) x HOP_SECONDS for the N nodes holding layers; then the most even (least sum of
  squares); then the one giving earlier nodes more layers;
- a node gets no layers, and is left out of the ring, when every split that gives it one is slower at its slowest
  stage than one without it (one layer on it would be the ring's bottleneck), or when it doesn't lower the time
  per token at an equal slowest stage (one hop less), or when its memory can't hold a layer. The others must hold
  the model: no split within every node's memory is a `PartitionError` (node/core/placement/partition.py).

Stable: speeds are quantised to SPEED_STEP (10%) steps and memory caps down to MEMORY_QUANTUM before use, so a
measurement's noise, or a few MB more or less free memory, leaves the ring as it is. Memory is only a cap: until a
node is nearly full, its memory doesn't move a layer. Nodes without a measured speed (0) count as the median of
the measured ones (all equal when none is). Without layer costs (None) each layer costs 1 and no hop is counted
(the speeds then only weigh the nodes against each other).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

SPEED_STEP = 1.1  # speeds are rounded to a power of this: two speeds within ~10% count as one
MEMORY_QUANTUM = 256 << 20  # memory caps are rounded down to this (or 1/16 of a small cap's power of two)
HOP_SECONDS = 5e-4  # what one more hop adds to a token's trip round the ring (serialising, gRPC, the link)
FS = 10**15  # stage times are whole femtoseconds: exact integer sums, the same on every node
MAX_SPEED = 1e6  # billions of parameters per second: far above any machine, a bound for what a peer reports


def speed_level(speed: float) -> int:
    """The quantised step of a speed (> 0): speeds within about half a step of each other share it."""
    return round(math.log(speed) / math.log(SPEED_STEP))


def memory_cap(memory_bytes: int) -> int | None:
    """The memory a node may be given, rounded down to MEMORY_QUANTUM (1/16 of its power of two when smaller);
    None: no cap (a node reporting no memory is not judged)."""
    if memory_bytes <= 0:
        return None
    quantum = min(MEMORY_QUANTUM, 1 << max(memory_bytes.bit_length() - 5, 0))
    return memory_bytes // quantum * quantum


def fs_per_cost(speeds: Sequence[float], costs_known: bool) -> list[int]:
    """Each node's time per unit of layer cost, in femtoseconds, from its speed in billions of parameters per
    second (0: not measured)."""
    levels = [speed_level(s) for s in speeds if s > 0]
    default = sorted(levels)[(len(levels) - 1) // 2] if levels else 0
    unit = 10**6 if costs_known else 10**9  # fs per parameter at 1 Gparam/s; per layer, an arbitrary scale
    return [round(unit / SPEED_STEP ** (speed_level(s) if s > 0 else default)) for s in speeds]


def balanced_counts(
    times: tuple[int, ...], caps: tuple[int | None, ...], costs: tuple[int, ...], feet: tuple[int, ...] | None, hop: int
) -> tuple[int, ...] | None:
    """Layers of each node in order (0: left out) by the rule above; `times`: fs per unit cost, `caps`: bytes or
    None, `feet`: each layer's bytes (weights + KV) or None (no caps), `hop`: fs. None when no split fits."""
    return _balanced(times, caps, costs, feet, hop)


@lru_cache(maxsize=256)
def _balanced(
    times: tuple[int, ...], caps: tuple[int | None, ...], costs: tuple[int, ...], feet: tuple[int, ...] | None, hop: int
) -> tuple[int, ...] | None:
    n, L = len(times), len(costs)
    cum, mem = [0], [0]
    for j in range(L):
        cum.append(cum[-1] + costs[j])
        mem.append(mem[-1] + (feet[j] if feet is not None else 0))

    def fits(i: int, a: int, b: int) -> bool:
        return caps[i] is None or feet is None or mem[b] - mem[a] <= caps[i]

    inf = None
    # slowest[i][j]: the least slowest stage placing layers j.. on nodes i..; None: can't
    slowest: list[list[int | None]] = [[inf] * (L + 1) for _ in range(n + 1)]
    slowest[n][L] = 0
    for i in range(n - 1, -1, -1):
        for j in range(L + 1):
            best = inf
            for e in range(j, L + 1):
                if not fits(i, j, e):
                    break  # more layers need more memory
                rest = slowest[i + 1][e]
                if rest is not None:
                    worst = max((cum[e] - cum[j]) * times[i], rest)
                    best = worst if best is None else min(best, worst)
            slowest[i][j] = best
    bound = slowest[0][0]
    if bound is None:
        return None
    # value[i][j]: (time per token, sum of squares) placing layers j.. on nodes i.., every stage within `bound`
    value: list[list[tuple[int, int] | None]] = [[inf] * (L + 1) for _ in range(n + 1)]
    value[n][L] = (0, 0)

    def options(i: int, j: int):
        for e in range(L, j - 1, -1):  # more layers first: ties go to the earlier node
            stage = (cum[e] - cum[j]) * times[i]
            rest = value[i + 1][e]
            if rest is not None and stage <= bound and fits(i, j, e):
                yield e, (rest[0] + stage + (hop if e > j else 0), rest[1] + stage * stage)

    for i in range(n - 1, -1, -1):
        for j in range(L + 1):
            value[i][j] = min((v for _, v in options(i, j)), default=None)
    counts, j = [], 0
    for i in range(n):
        e = next(e for e, v in options(i, j) if v == value[i][j])
        counts.append(e - j)
        j = e
    return tuple(counts)
