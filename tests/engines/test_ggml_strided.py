"""Lone rows at one stride (shards/engines/ggml/layout.py's strided groups): decoding requests whose ranges have one
size and lie one after another attend in one flash-attention op, the requests in its fourth dimension, each row
over its own range only, as llama.cpp's per-slot caches do. Where the requests' ranges break the pattern the rows
attend in span groups as before; either way every row's numbers are bit for bit those of its request alone."""

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.base import StepInput
from shards.engines.ggml import layout
from shards.engines.ggml.graph import Group
from shards.engines.ggml.lib import g
from tests.engines.test_ggml_cells import LAYERS, smollm2
from tests.support.ggml_graph import graph_ops


def decode(e, prompts, reserve: int, steps: int = 2) -> tuple[list[np.ndarray], list[list[StepInput]]]:
    """The engine reads the prompts as requests r0, r1, ... one at a time, then decodes them side by side: the
    logits of every decode step's rows in order, and the steps."""
    for i, prompt in enumerate(prompts):
        e.forward([StepInput(f"r{i}", tokens=prompt, max_positions=reserve)])
    rows = [[StepInput(f"r{i}", tokens=np.array([7 + i + 50 * k])) for i in range(len(prompts))] for k in range(steps)]
    return [logits for step in rows for logits in e.forward(step)], rows


def test_sixteen_lone_rows_attend_in_one_flash_op_each_over_its_own_range_with_the_numbers_each_gets_alone(
    monkeypatch,
):
    """16 requests decoding side by side, each range 256 cells at a stride of 256: one group, one flash-attention op
    per layer reading 16 query rows in its fourth dimension, keys of 256 cells each, and each row scans its own
    256 cells rather than a span of its neighbours' (1,024 in the span groups). Logits are those of each request
    decoding alone, and of the span groups."""
    e, spans, alone = (smollm2(layers=LAYERS) for _ in range(3))
    prompts = [np.random.default_rng(i).integers(100, 5000, 40) for i in range(16)]
    monkeypatch.setattr(layout, "STRIDED", False)
    by_spans, _ = decode(spans, prompts, reserve=170)
    monkeypatch.setattr(layout, "STRIDED", True)
    together, steps = decode(e, prompts, reserve=170)  # a reservation below 256 cells still takes a 256-cell range
    caches = [e.caches[f"r{i}"] for i in range(16)]
    assert {c.capacity for c in caches} == {256} and {b.start - a.start for a, b in zip(caches, caches[1:])} == {256}
    shape = e.runner.shape(e.pack(steps[0]), caches, False)
    assert shape.groups == (Group(16, caches[0].start, 256, stride=256),)
    flash = graph_ops(e.runner.graphs.get(shape).gf, e.runner.graphs.get(shape).nodes, g.GGML_OP_FLASH_ATTN_EXT)
    assert len(flash) == LAYERS
    assert all(list(f.src[0].contents.ne) == [e.config.head_dim, 1, e.config.n_heads, 16] for f in flash)
    assert all(f.src[1].contents.ne[1] == 256 for f in flash)  # keys: a row's own range
    for i, prompt in enumerate(prompts):
        alone.forward([StepInput(f"r{i}", tokens=prompt, max_positions=170)])
        for k in range(2):
            assert np.array_equal(alone.forward([steps[k][i]])[0], together[16 * k + i]), (k, i)
        alone.release(f"r{i}")
    assert all(np.array_equal(a, b) for a, b in zip(together, by_spans))
    for engine in (e, spans, alone):
        engine.close()


@pytest.fixture
def spans_only(monkeypatch):
    monkeypatch.setattr(layout, "STRIDED", False)


def test_the_span_groups_are_what_strided_groups_are_checked_against(spans_only):
    """With strided groups off the same step attends in span groups of neighbours (the reference above)."""
    e = smollm2(layers=LAYERS)
    prompts = [np.random.default_rng(i).integers(100, 5000, 40) for i in range(16)]
    _, steps = decode(e, prompts, reserve=170, steps=1)
    shape = e.runner.shape(e.pack(steps[0]), [e.caches[f"r{i}"] for i in range(16)], False)
    assert len(shape.groups) > 1 and not any(gr.stride for gr in shape.groups)
    e.close()


def test_a_range_out_of_step_splits_the_run_and_every_row_keeps_its_numbers(monkeypatch):
    """The sixth request's long prompt took a 512-cell range elsewhere: the rows before it and after it attend in
    strided groups of their own, it in a span group, and the logits are the span groups' bit for bit."""
    e, spans = smollm2(layers=LAYERS), smollm2(layers=LAYERS)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(100, 5000, 300 if i == 5 else 40) for i in range(8)]
    monkeypatch.setattr(layout, "STRIDED", False)
    by_spans, _ = decode(spans, prompts, reserve=700)
    monkeypatch.setattr(layout, "STRIDED", True)
    together, steps = decode(e, prompts, reserve=700)
    shape = e.runner.shape(e.pack(steps[0]), [e.caches[f"r{i}"] for i in range(8)], False)
    assert [(gr.rows, gr.stride > 0) for gr in shape.groups] == [(5, True), (1, False), (2, True)]
    assert all(np.array_equal(a, b) for a, b in zip(together, by_spans))
    for engine in (e, spans):
        engine.close()


def test_rows_run_in_their_ranges_order_and_come_back_in_the_steps():
    """Requests decoding in another order than their ranges lie in (the reverse here, as after requests came and
    went) still attend as one strided group: the runner orders a step of lone rows by range and hands each row's
    logits back in the step's order, the same bit for bit as in range order."""
    e = smollm2(layers=LAYERS)
    prompts = [np.random.default_rng(i).integers(100, 5000, 40) for i in range(6)]
    decode(e, prompts, reserve=300)
    reverse = e.forward([StepInput(f"r{i}", tokens=np.array([3 + i])) for i in reversed(range(6))])
    assert e.runner.last.scanned == 6 * 256  # each row over its own range: one strided group
    twin = smollm2(layers=LAYERS)
    decode(twin, prompts, reserve=300)
    forward = twin.forward([StepInput(f"r{i}", tokens=np.array([3 + i])) for i in range(6)])
    assert all(np.array_equal(a, b) for a, b in zip(reverse, reversed(forward)))
    for engine in (e, twin):
        engine.close()
