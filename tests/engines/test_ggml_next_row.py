"""A lone decode row's next step is set up from its last one (shards/engines/ggml/next_row.py): the same graph, its
token, position and cell, one more visible cell. Whatever comes between (another request's step, both at once,
a rollback, a range that grows and moves, a pick or a forward), every step's numbers are bit for bit those of an
engine that lays out and fills every step in full, and its graph's inputs are the same; a plain decode takes the
short way at every step but its first."""

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.base import StepInput
from tests.engines.test_ggml_cells import smollm2


def step(e, rows: dict[str, int], pick: bool, fresh: dict[str, np.ndarray]) -> list:
    batch = [StepInput(r, tokens=fresh.get(r, np.array([t])), max_positions=300) for r, t in rows.items()]
    if pick:
        return [p.tokens if p.tokens is not None else p.logits for p in e.pick(batch, [True] * len(batch))]
    return e.forward(batch)


def test_every_step_taken_from_the_last_equals_the_full_one_whatever_comes_between():
    short, full = smollm2(layers=2), smollm2(layers=2)
    full.runner.next_rows = False
    rng = np.random.default_rng(7)
    prompts = {r: rng.integers(100, 5000, 20) for r in "ab"}
    plan = ["a"] * 40 + ["b"] * 3 + ["ab"] * 2 + ["a"] * 5 + ["rollback"] + ["a"] * 230 + ["b"] + ["a"] * 3
    token, started = {"a": 5, "b": 6}, set()
    try:
        for k, what in enumerate(plan):
            if what == "rollback":  # a rejected proposal's positions dropped: the row goes on from an earlier one
                for e in (short, full):
                    e.rollback("a", e.cache_length("a") - 3)
                continue
            rows = {r: token[r] for r in what}
            fresh = {r: prompts[r] for r in rows if r not in started}
            started |= set(rows)
            pick = k % 7 != 3
            got, want = step(short, rows, pick, fresh), step(full, rows, pick, fresh)
            for r, a, b in zip(rows, got, want):
                assert np.array_equal(a, b), f"step {k} ({what}): request {r} differs"
                token[r] = int(a[0]) if isinstance(a, tuple) else int(np.argmax(a[-1]))
            row = short.runner._row
            if row is not None:  # the graph's inputs as the full path would have filled them
                other = full.runner.graphs.graphs[row.shape]
                assert np.array_equal(row.graph.ints_np, other.ints_np), f"step {k}"
                assert np.array_equal(row.graph.mask_np, other.mask_np), f"step {k}"
                assert np.array_equal(row.graph.out_ids_np, other.out_ids_np), f"step {k}"
        assert short.cache_length("a") > 256  # its range grew (and moved) on the way
        assert short.runner.next_row_steps >= 0.6 * plan.count("a")  # (a pick after a forward starts over)
        assert full.runner.next_row_steps == 0
    finally:
        short.close()
        full.close()


def test_a_plain_decode_takes_the_short_way_at_every_step_but_its_first():
    e = smollm2(layers=1)
    try:
        e.forward([StepInput("a", tokens=np.arange(100, 120), max_positions=300)])
        for _ in range(20):
            e.pick([StepInput("a", tokens=np.array([7]))], [True])
        assert e.runner.next_row_steps == 19
        e.forward([StepInput("b", tokens=np.arange(100, 104), max_positions=300)])  # another request's step
        e.pick([StepInput("a", tokens=np.array([7]))], [True])
        assert e.runner.next_row_steps == 19  # laid out in full again
    finally:
        e.close()
