"""The ggml engine's KV cells and step graphs: every request's keys and values in one pool of cells, each request
a contiguous range of them (shards/engines/ggml/cells.py), and one graph per step shape, not per set of requests
(shards/engines/ggml/graph.py). A row's numbers don't depend on where its cells lie or on what shares its step, and
a burst of 64 requests at a fresh engine costs steps like the engine's own and builds a handful of graphs."""

import ctypes
import dataclasses
import time

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.base import StepInput
from shards.engines.ggml.attention import SPLIT_KV_CELLS
from shards.engines.ggml.cells import GIVE_BACK_CELLS, CellPool
from shards.engines.ggml.engine import GgmlEngine
from shards.engines.ggml.graph import SPARE_SHARE, WINDOW_STEP, padded_rows
from shards.engines.ggml.layout import SPAN_CELLS
from shards.engines.ggml.lib import g
from shards.formats.loader import load_config
from shards.model.shard import Shard
from tests.support.ggml_graph import graph_ops
from tests.support.gguf_util import smollm2_path

LAYERS = 4  # engine tests below run SmolLM2's first layers only: quick, and the same shapes and kernels


def smollm2(threads: int = 1, layers: int | None = None) -> GgmlEngine:
    """A fresh engine on the packaged SmolLM2, in its file's own Q4_1 blocks, on `threads` threads (always); with
    `layers`, a model of only its first layers (embedding, those layers, norm and head: quick, and the same shapes)."""
    path = smollm2_path()
    cfg = load_config(path)
    cfg = cfg if layers is None else dataclasses.replace(cfg, n_layers=layers)
    shard = Shard("m", 0, cfg.n_layers, cfg.n_layers)
    return GgmlEngine(path, shard, cfg, threads=threads, quantize="none", adapt_threads=False)


def cells(pool: CellPool, layer: int, start: int, n: int) -> np.ndarray:
    """A view of cells [start, start+n) of a layer's keys, as F16 values."""
    base = pool.k[layer].contents.data + start * pool.row
    return np.ctypeslib.as_array((ctypes.c_uint16 * (n * pool.width)).from_address(base)).view(np.float16)


# -- the pool ---------------------------------------------------------------------------------------------------------
def test_ranges_are_taken_first_fit_from_the_low_end_and_merged_when_given_back():
    pool = CellPool(2, 1, 32, 64)
    a, b, c = pool.allocate(10), pool.allocate(20), pool.allocate(5)
    assert (a, b, c) == (1, 11, 31)  # cell 0 is the scratch cell padding rows write to
    pool.release(b, 20)
    assert pool.allocate(8) == 11  # the lowest hole that fits
    with pytest.raises(ValueError, match="already free"):
        pool.release(b + 10, 5)
    with pytest.raises(ValueError, match="not a range"):
        pool.release(0, 1)
    pool.release(a, 10)
    pool.release(11, 8)
    pool.release(c, 5)
    assert pool.free_ranges == [(1, 64)]
    pool.free()


def test_a_full_pool_doubles_and_keeps_every_range_where_it_was():
    pool = CellPool(1, 1, 32, 16)
    a = pool.allocate(10)
    cells(pool, 0, a, 10)[:] = np.arange(320, dtype=np.float16)
    b = pool.allocate(10)  # does not fit in 16 cells: the pool moves into 32
    assert (pool.cells, pool.generation, b) == (32, 1, 11)
    assert np.array_equal(cells(pool, 0, a, 10), np.arange(320, dtype=np.float16))
    pool.free()


def test_cells_go_back_to_the_kernel_a_page_of_every_line_at_a_time():
    """Freed cells read as zeros again once given back: a large range as it ends, small ones when the pool's free
    tail holds a page of every line of them. A small range freed in between stays, for the next one to take without
    faulting its pages in again."""
    pool = CellPool(1, 4, 64, 4 * GIVE_BACK_CELLS, gemm_from=0)  # keys as rows, values in lines
    quarter = GIVE_BACK_CELLS // 4
    head = pool.allocate(GIVE_BACK_CELLS - 1)  # cells 1.. up to the first page of every line's end
    small = [pool.allocate(quarter) for _ in range(4)]
    big = pool.allocate(GIVE_BACK_CELLS)
    tail = pool.allocate(64)
    for start, n in [(head, GIVE_BACK_CELLS - 1), *((s, quarter) for s in small), (big, GIVE_BACK_CELLS), (tail, 64)]:
        cells(pool, 0, start, n)[:] = 1.5
        pool.values(0)[:, start : start + n] = 1.5
    pool.release(big, GIVE_BACK_CELLS)  # a hole, but a large one
    assert not cells(pool, 0, big, GIVE_BACK_CELLS).any() and not pool.values(0)[:, big : big + GIVE_BACK_CELLS].any()
    pool.release(tail, 64)
    for s in small[:0:-1]:
        pool.release(s, quarter)  # the free tail grows by small ranges, still held
        assert (cells(pool, 0, s, quarter) == 1.5).all() and (pool.values(0)[:, s : s + quarter] == 1.5).all()
    pool.release(small[0], quarter)  # now a page of every line is free and held: it goes
    assert not cells(pool, 0, small[0], 4 * quarter).any()
    assert not pool.values(0)[:, small[0] : small[0] + 4 * quarter].any()
    assert (cells(pool, 0, head, GIVE_BACK_CELLS - 1) == 1.5).all() and (
        pool.values(0)[:, head : small[0]] == 1.5
    ).all()
    pool.free()


def test_steps_of_many_rows_pad_to_few_row_counts():
    assert [padded_rows(n) for n in (1, 2, 3, 9, 17, 63, 64, 65, 93, 128)] == [1, 2, 3, 9, 17, 63, 64, 72, 96, 128]


# -- exactness --------------------------------------------------------------------------------------------------------
def test_a_lone_row_over_many_cells_equals_the_same_row_prefilled_or_beside_others():
    """From SPLIT_KV_CELLS cells on, ggml splits a lone row's cells across threads and merges the parts, in another
    order than the row-at-a-time kernel a prefill or a batch takes (0.29 apart in the logits here); the engine never
    lets it, wherever the request's cells lie in the window."""
    e = smollm2(threads=2, layers=LAYERS)
    tokens = np.random.default_rng(5).integers(100, 5000, 41)
    e.forward([StepInput("holder", tokens=tokens[:1], max_positions=230)])  # cells 64..293 (ranges: CELL_ALIGN)
    e.forward([StepInput("lone", tokens=tokens[:-1], max_positions=200)])  # cells 320..519: a span of 512
    whole = e.forward([StepInput("whole", tokens=tokens, max_positions=41)], all_logits=True)[0][-1]
    lone_step = [StepInput("lone", tokens=tokens[-1:])]
    assert e.runner.shape(e.pack(lone_step), [e.caches["lone"]], False).groups[0].cells >= SPLIT_KV_CELLS
    lone = e.forward(lone_step)[0][0]
    e.forward([StepInput("busy", tokens=tokens[:-1], max_positions=41), StepInput("x", tokens=tokens[:9])])
    beside = e.forward([StepInput("x", tokens=tokens[9:10]), StepInput("busy", tokens=tokens[-1:])])[1][0]
    assert np.array_equal(lone, whole) and np.array_equal(beside, whole)
    e.close()


def test_a_lone_row_over_many_cells_is_attended_once_not_beside_a_copy_of_itself():
    """The row's heads go in the op's fourth dimension (attention.py: lone_row_attention), which keeps ggml on the
    row-at-a-time kernel without the copy the row was once attended beside: a decode step's attention costs one
    row's, each layer's flash op reading one query row per head."""
    e = smollm2(threads=2, layers=LAYERS)
    tokens = np.random.default_rng(5).integers(100, 5000, 41)
    e.forward([StepInput("holder", tokens=tokens[:1], max_positions=230)])
    e.forward([StepInput("lone", tokens=tokens[:-1], max_positions=200)])
    lone_step = [StepInput("lone", tokens=tokens[-1:])]
    shape = e.runner.shape(e.pack(lone_step), [e.caches["lone"]], False)
    e.forward(lone_step)
    graph = e.runner.graphs.get(shape)
    flash = graph_ops(graph.gf, graph.nodes, g.GGML_OP_FLASH_ATTN_EXT)
    query_rows = [int(np.prod(list(n.src[0].contents.ne))) // e.config.head_dim for n in flash]
    assert shape.groups[0].cells >= SPLIT_KV_CELLS and query_rows == [e.config.n_heads] * LAYERS
    e.close()


def test_sixteen_decode_rows_attend_in_groups_of_neighbours_with_the_numbers_each_gets_alone(monkeypatch):
    """A row scans every cell of its group's span (the masked ones skipped, but each looked at): one group over 16
    requests of ~170 cells made each row scan 4,096 cells. Rows now attend in groups of neighbouring requests
    spanning at most SPAN_CELLS (+ alignment), a decode step's shape is the same step after step (no graph built),
    and every row's logits are bit for bit those of its request decoding alone. (Ranges of one size at one stride
    attend as a strided group instead, tests/engines/test_ggml_strided.py: off here.)"""
    monkeypatch.setattr("shards.engines.ggml.layout.STRIDED", False)
    e, alone = smollm2(layers=LAYERS), smollm2(layers=LAYERS)
    rng = np.random.default_rng(16)
    prompts = [rng.integers(100, 5000, 40) for _ in range(16)]
    for i, prompt in enumerate(prompts):
        e.forward([StepInput(f"r{i}", tokens=prompt, max_positions=170)])
        alone.forward([StepInput(f"r{i}", tokens=prompt, max_positions=170)])
    steps = [[StepInput(f"r{i}", tokens=np.array([7 + i + 50 * k])) for i in range(16)] for k in range(2)]
    shape = e.runner.shape(e.pack(steps[0]), [e.caches[f"r{i}"] for i in range(16)], False)
    assert len(shape.groups) > 1 and all(gr.cells <= SPAN_CELLS + 2 * WINDOW_STEP for gr in shape.groups)
    scanned = sum(gr.rows * gr.cells for gr in shape.groups)
    assert scanned <= 16 * 4096 // 3, f"rows scan {scanned} cells in all, {shape.groups}"  # one group: 16 x 4,096
    together = e.forward(steps[0])
    builds = e.graphs.builds
    together += e.forward(steps[1])
    assert e.graphs.builds == builds  # the second decode step runs the first one's graph
    for k in range(2):
        for i in range(16):
            mine = alone.forward([steps[k][i]])[0]
            assert np.array_equal(mine, together[16 * k + i]), (k, i)
    for engine in (e, alone):
        engine.close()


# -- a burst at a fresh engine ----------------------------------------------------------------------------------------
PROMPTS = [np.random.default_rng(i).integers(100, 5000, 4 + i % 9) for i in range(64)]
NEW_TOKENS, CHUNK = 16, 128


def burst(e: GgmlEngine, run: int) -> list[tuple[int, float]]:
    """64 requests at once, scheduled as a node does: every step decodes all running requests and prefills waiting
    prompts within CHUNK rows; each generates NEW_TOKENS greedy tokens and is released. (rows, seconds) per step."""
    waiting, running, steps = list(range(64)), {}, []
    while waiting or running:
        batch = [StepInput(f"{run}.{i}", tokens=np.array([last])) for i, (last, _) in running.items()]
        rows = len(batch)
        while waiting and rows + len(PROMPTS[waiting[0]]) <= CHUNK:
            i = waiting.pop(0)
            batch.append(StepInput(f"{run}.{i}", tokens=PROMPTS[i], max_positions=len(PROMPTS[i]) + NEW_TOKENS))
            rows += len(PROMPTS[i])
        t0 = time.perf_counter()
        out = e.forward(batch)
        steps.append((rows, time.perf_counter() - t0))
        for item, logits in zip(batch, out):
            i = int(item.request_id.split(".")[1])
            made = running.get(i, (0, 0))[1] + 1
            running[i] = (int(np.argmax(logits[-1])), made)
            if made == NEW_TOKENS:
                del running[i]
                e.release(item.request_id)
    return steps


def test_a_range_holds_what_its_request_has_and_doubles_up_to_its_reservation_with_the_same_numbers():
    """A decode step attends one window over every request's range, so a range sized by its reservation (a request
    without max_tokens reserves the node's cap) made every row scan that many masked cells: 8 requests of 64
    positions with 1,200-cell reservations cost 1.6x the CPU of 128-cell ones. A range starts at what the request
    holds (at least 256 cells) and doubles as it grows, never past its reservation, and moving changes no bit."""
    big, small = smollm2(layers=LAYERS), smollm2(layers=LAYERS)
    prompt = np.arange(10) + 100
    big.forward([StepInput("r", tokens=prompt, max_positions=2000)])
    small.forward([StepInput("r", tokens=prompt, max_positions=300)])
    assert big.caches["r"].capacity == small.caches["r"].capacity == 256
    chunk = (np.arange(250) % 50) + 200
    a = big.forward([StepInput("r", tokens=chunk)])[0]  # 260 positions: moved to a range of 512
    b = small.forward([StepInput("r", tokens=chunk)])[0]  # capped by its reservation: 300
    assert big.caches["r"].capacity == 512 and small.caches["r"].capacity == 300
    assert np.array_equal(a, b)
    for e in (big, small):
        e.close()


def test_a_prompt_of_known_length_takes_its_range_at_its_first_chunk_and_is_never_moved():
    """A 1,000-token prompt in 256-row chunks moved 256 -> 512 -> 1,024 cells, copying what it held each time and
    leaving each old range as a hole below GIVE_BACK_CELLS, which stays resident: on a 7B shard a long prompt held
    its cells about twice. Told the prompt's length, the first chunk takes the range the doubling reaches by the
    prompt's end (a power of two, capped by the reservation), nothing is copied, and the numbers are the same."""
    told, untold = smollm2(layers=LAYERS), smollm2(layers=LAYERS)
    prompt = (np.arange(1000) % 97) + 100
    outs = {}
    for e, hint in ((told, 1000), (untold, None)):
        for s in range(0, 1000, 256):
            outs[e] = e.forward([StepInput("r", tokens=prompt[s : s + 256], max_positions=1100, prompt_positions=hint)])
        outs[e] = (outs[e], e.forward([StepInput("r", tokens=np.array([7]))])[0])
    assert told.caches["r"].capacity == 1024 and told.pool.copied == 0
    assert untold.caches["r"].capacity == 1024 and untold.pool.copied == 256 + 512
    assert np.array_equal(outs[told][0][0], outs[untold][0][0]) and np.array_equal(outs[told][1], outs[untold][1])
    capped = smollm2(layers=LAYERS)  # the reservation caps it, and a hint past it is ignored
    capped.forward([StepInput("r", tokens=prompt[:256], max_positions=700, prompt_positions=4000)])
    short = smollm2(layers=LAYERS)  # a short prompt takes the smallest range, as before
    short.forward([StepInput("r", tokens=prompt[:10], max_positions=700, prompt_positions=10)])
    assert capped.caches["r"].capacity == 700 and short.caches["r"].capacity == 256
    for e in (told, untold, capped, short):
        e.close()


def test_64_requests_at_a_fresh_engine_cost_steps_like_its_own_and_build_a_handful_of_graphs():
    """Issue #28 item 5: a burst at a fresh node took 2.6-23.5 s per step, when every new set of requests meant a
    new graph (21,805 nodes for 64 requests). Now graphs are per shape: the engine's own cost of a 64-row step,
    measured first on a warm graph, bounds every step of three bursts (graph builds included), the first two on
    one fresh engine, the third on another; a burst builds a handful of graphs (the same on a fresh engine), and the
    same burst again, every request new, fewer (ranges that grew left the pool's free cells laid out otherwise, so
    a few windows differ)."""
    e = smollm2(layers=LAYERS)
    e.forward([StepInput(f"w{i}", tokens=np.arange(2) + 100, max_positions=12) for i in range(64)])
    e.forward([StepInput(f"w{i}", tokens=np.array([7])) for i in range(64)])  # builds the 64-row decode graph
    timed = []
    for _ in range(3):
        t0 = time.perf_counter()
        e.forward([StepInput(f"w{i}", tokens=np.array([7])) for i in range(64)])
        timed.append(time.perf_counter() - t0)
    unit = min(timed)  # the engine's cost of a 64-row step with its graph built
    e.close()
    engine, builds = smollm2(layers=LAYERS), []
    for run in range(3):
        if run == 2:
            engine.close()
            engine = smollm2(layers=LAYERS)
        before = engine.graphs.builds
        steps = burst(engine, run)
        builds.append(engine.graphs.builds - before)
        assert not engine.caches and engine.cache_bytes() == 0
        worst = max(seconds / max(1.0, rows / 64) for rows, seconds in steps)
        assert worst < 10 * unit, f"run {run}: a step took {worst:.3f} s per 64 rows; a warm 64-row step {unit:.3f} s"
    assert builds[0] == builds[2] <= 16 and builds[0] < len(steps) and builds[1] < builds[0], (builds, len(steps))
    engine.close()


def test_the_graphs_kept_hold_the_newest_ones_buffer_and_a_bounded_spare_whatever_prompts_came():
    """Every prompt chunk builds a graph of its own span, and each graph keeps a compute buffer for its re-runs:
    kept, they grew a node's memory with every prompt it prefilled (130 MB per 256-row chunk of a 7B-shaped shard).
    Beside the newest graph the cache keeps at most its spare bytes, none over a share of them, the largest graphs
    dropped first, so the decode step's small graph stays built."""
    e = smollm2(layers=2)
    e.forward([StepInput("d", tokens=np.arange(5) + 100, max_positions=64)])
    e.forward([StepInput("d", tokens=np.array([7]))])
    decode = e.graphs.graphs[next(reversed(e.graphs.graphs))]
    e.graphs.spare_bytes = SPARE_SHARE * decode.compute_bytes  # room for the decode graph and its like, no chunk's
    prompt = np.random.default_rng(5).integers(100, 5000, 600)
    for i, n in enumerate((256, 200, 150, 100)):
        e.forward([StepInput(f"p{i}", tokens=prompt[:n], max_positions=700)])
        newest = e.graphs.graphs[next(reversed(e.graphs.graphs))]
        assert newest.compute_bytes > e.graphs.spare_bytes  # a chunk's buffer: more than the spare
        assert e.graphs.compute_bytes <= newest.compute_bytes + e.graphs.spare_bytes
    builds = e.graphs.builds
    e.forward([StepInput("d", tokens=np.array([8]))])
    assert e.graphs.builds == builds  # the decode graph was kept
    e.close()


def test_a_chunks_graph_is_not_kept_beside_the_decode_graph_even_when_the_spare_has_room():
    """A prompt chunk's graph holds more than a spare's share: once a step of another shape runs (built then, or
    kept from before) it goes, so a node idle after a prompt holds the decode graphs' buffers, not a chunk's."""
    e = smollm2(layers=2)
    e.forward([StepInput("d", tokens=np.arange(5) + 100, max_positions=64)])
    e.forward([StepInput("d", tokens=np.array([7]))])  # the decode graph, built
    decode = e.graphs.graphs[next(reversed(e.graphs.graphs))]
    for turn in range(2):
        e.forward([StepInput(f"p{turn}", tokens=np.arange(120) + 200, max_positions=256)])
        chunk = e.graphs.graphs[next(reversed(e.graphs.graphs))]
        e.graphs.spare_bytes = SPARE_SHARE * (chunk.compute_bytes - 1)  # room for it, but not within one share
        assert decode.compute_bytes + chunk.compute_bytes <= e.graphs.spare_bytes
        builds = e.graphs.builds
        e.forward([StepInput("d", tokens=np.array([8 + turn]))])
        assert e.graphs.builds == builds  # the decode graph came from the cache, and the chunk's went
        assert chunk.shape not in e.graphs.graphs and e.graphs.compute_bytes <= e.graphs.spare_bytes
    e.close()
