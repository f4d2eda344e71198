"""A long prompt's prefill costs the ggml engine per token what a short one's does, but for attention's own share:
every row attends its request's cells up to its position, so that part grows with the position and nothing else
may. Counted, not timed (the runner's StepWork, the pool's copied cells): the same on a busy machine. A prompt of
2,048 tokens against one of 256, in the node's chunks: per token the same padded rows, at most one graph built per
chunk, range moves that copy under a cell per token, graph copies that do not grow with the cells attended, and an
attention scan per row of the row's own cells plus a bounded margin (the chunk's later rows and the span's
alignment), never a span that grows faster than the prompt (a range's capacity, the pool, a mask over every cell
seen so far)."""

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from node.core.scheduler import SchedulerLimits
from shards.engines.base import StepInput
from shards.engines.ggml import attention
from shards.engines.ggml.attention import GEMM_FROM
from shards.engines.ggml.graph import WINDOW_STEP
from tests.engines.test_ggml_cells import smollm2

CHUNK = SchedulerLimits().prefill_chunk  # what a node prefills per request and step
LAYERS = 1  # the work counted is the same in every layer: one counts what thirty would


def prefill(tokens: int) -> tuple[list, int, list[int]]:
    """A fresh engine prefills `tokens` positions of one request in CHUNK-position steps; each step's StepWork,
    the cells copied per tensor, and the bytes each step's graph copies."""
    e = smollm2(layers=LAYERS)
    prompt = np.random.default_rng(tokens).integers(100, 5000, tokens)
    work, graph_copies = [], []
    for at in range(0, tokens, CHUNK):
        e.forward([StepInput("r", tokens=prompt[at : at + CHUNK], max_positions=tokens + 64)])
        work.append(e.runner.last)
        graph_copies.append(next(reversed(e.graphs.graphs.values())).copied_bytes())  # the step's graph: last used
    copied = e.pool.copied
    e.close()
    return work, copied, graph_copies


@pytest.fixture(scope="module")
def short_and_long():
    return prefill(256), prefill(2048)


def test_work_outside_attention_per_token_is_the_same_for_a_long_prompt_as_for_a_short_one(short_and_long):
    for tokens, (work, copied, _) in zip((256, 2048), short_and_long):
        assert sum(w.rows for w in work) == tokens  # chunks of CHUNK rows need no padding rows
        assert sum(w.built for w in work) <= len(work)  # at most one graph built per chunk
        assert copied <= tokens, f"{tokens} tokens: range moves copied {copied} cells per tensor"


def test_a_rows_attention_scans_its_own_cells_and_a_margin_that_does_not_grow_with_the_prompt(short_and_long):
    for work, _, _ in short_and_long:
        for k, w in enumerate(work):
            end = (k + 1) * CHUNK  # the chunk's last position + 1
            assert w.visible == CHUNK * (k * CHUNK) + CHUNK * (CHUNK + 1) // 2  # row p attends p + 1 cells
            assert w.scanned - w.visible <= w.rows * (CHUNK + WINDOW_STEP), (k, w)  # masked: a bounded margin
            assert w.scanned <= w.rows * (end + WINDOW_STEP), (k, w)  # up to its own position, aligned
    (short, _, _), (long, _, _) = short_and_long
    per_token = [sum(w.scanned for w in work) / sum(w.rows for w in work) for work in (short, long)]
    mean_end = [256 / 2 + CHUNK, 2048 / 2 + CHUNK]  # a row's mean position, plus the margin's bound
    assert per_token[1] / per_token[0] <= mean_end[1] / mean_end[0] * 1.5, per_token


def test_a_chunks_graph_copies_are_of_its_own_rows_however_many_cells_it_attends(short_and_long):
    """Copies move data beside the math; one that grows with the cells attended (the span's values transposed every
    step, before the pool kept them transposed) made a long prompt's chunks cost more per token outside attention.
    A chunk attending by matmuls (from the pool's gemm_from on) copies its own rows' output once, F32: the same for
    its chunk wherever it lies."""
    (_, _, short), (_, _, long) = short_and_long
    cfg = smollm2(layers=LAYERS).config
    own_rows = CHUNK * cfg.n_heads * cfg.head_dim * 4 * LAYERS
    assert max(long) <= max(short) + own_rows, (short, long)  # chunks of CHUNK rows each
    assert len(set(long[GEMM_FROM // CHUNK :])) == 1, long  # the same for every chunk past it


def test_matmul_attention_takes_a_chunks_rows_in_blocks_with_the_same_numbers_and_a_fraction_of_the_memory(
    monkeypatch,
):
    """A chunk's rows past GEMM_FROM attend by matmuls, whose F32 scores and their softmax held rows x cells x
    heads twice at once: 128 MB on a 7B's shard for a 256-row chunk at 2,048 cells, above the node's plan. They go
    in blocks of rows, at most SCORE_ROWS rows and SCORE_BYTES of scores at a time (smaller blocks stay in cache:
    faster too); each row's numbers are the same whatever the block (tinyBLAS sums in one order whatever the rows
    beside it), the graph's buffer is smaller by most of the scores' size, and blocks of the fewest rows (a 70B's
    many heads over a long context) still fit the graph's context."""
    prompt = np.random.default_rng(5).integers(100, 5000, GEMM_FROM + 2 * CHUNK)
    outs, buffers = [], []
    for rows, budget in ((10**9, 1 << 40), (attention.SCORE_ROWS, attention.SCORE_BYTES), (10**9, 1)):
        monkeypatch.setattr(attention, "SCORE_ROWS", rows)
        monkeypatch.setattr(attention, "SCORE_BYTES", budget)
        e = smollm2(layers=LAYERS)
        for at in range(0, len(prompt), CHUNK):
            last = at + CHUNK == len(prompt)  # every row's logits: each row's attention is compared
            step = StepInput("r", tokens=prompt[at : at + CHUNK], max_positions=len(prompt) + 8)
            out = e.forward([step], all_logits=last)[0]
            if at == GEMM_FROM:  # its graph's buffer: mostly the scores (only the last row's logits)
                buffers.append(next(reversed(e.graphs.graphs.values())).compute_bytes)
        outs.append(out)
        heads = e.config.n_heads
        e.close()
    scores = CHUNK * (GEMM_FROM + CHUNK) * heads * 4  # one chunk's scores over the cells it attends, F32
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])
    assert buffers[0] - buffers[1] > scores * 3 // 4, (buffers, scores)  # most of the scores' room goes
    assert attention.score_block(GEMM_FROM + CHUNK, heads) == attention.MIN_FLOAT_ROWS  # the last: the fewest rows
