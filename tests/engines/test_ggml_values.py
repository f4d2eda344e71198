"""The ggml engine keeps every layer's values in the layouts its attentions read (shards/engines/ggml/cells.py): for
the F16-matmul attention ("gemm") transposed, a line of cells per value element, llama.cpp's layout without flash
attention, so attention multiplies a span of values where they lie (GgmlBackend.gemm_attention); for flash attention
as the keys are; under "auto" both, flash rows below the pool's gemm_from and matmul rows from it. No step copies
the cells it attends. Whatever moves cells moves the values with the keys (a prefix
copied, a range outgrowing itself, the pool's growth), a step writes each row's values into its own cell and nowhere
else, the matmul attention gives every row the numbers it gets alone, in a prefill or decoding, and it gives llama.cpp's
flash-attention logits but for rounding."""

import ctypes
import dataclasses
import sys

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.base import StepInput
from shards.engines.ggml import attention as ggml_attention
from shards.engines.ggml.cells import PAGE, CellPool
from shards.engines.ggml.engine import GgmlEngine
from shards.engines.ggml.lib import F16, g
from shards.formats.loader import load_config
from shards.model.shard import Shard
from tests.engines.test_ggml_cells import smollm2
from tests.support.ggml_graph import graph_ops
from tests.support.gguf_util import smollm2_path
from tests.support.tolerance import clear_top1_disagreements, relative_rms

ROUNDING = 0.01  # RMS difference / spread of the logits: two attentions' F16 rounding over SmolLM2's first 4 layers


def keys(pool: CellPool, layer: int) -> np.ndarray:
    """A layer's keys as F16 [cells, kv_heads*head_dim] (a view)."""
    n = pool.cells * pool.width
    return (
        np.ctypeslib.as_array((ctypes.c_uint16 * n).from_address(pool.k[layer].contents.data))
        .view(np.float16)
        .reshape(pool.cells, pool.width)
    )


def fill(pool: CellPool, start: int, n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random keys and values into cells [start, start+n) of every layer (the values in each layout the pool
    keeps); what was written, per layer."""
    rng, out = np.random.default_rng(seed), []
    for layer in range(pool.n_layers):
        k, v = (rng.standard_normal((n, pool.width)).astype(np.float16) for _ in range(2))
        keys(pool, layer)[start : start + n] = k
        pool.values(layer)[:, start : start + n] = v.T
        if pool.value_rows and pool.transposed:
            pool.value_rows_of(layer)[start : start + n] = v
        out.append((k, v))
    pool.wrote_lines(start + n)  # as a step that writes values in lines says so
    return out


def held(pool: CellPool, start: int, written: list[tuple[np.ndarray, np.ndarray]]) -> bool:
    n = len(written[0][0])
    return all(
        np.array_equal(keys(pool, layer)[start : start + n], k)
        and np.array_equal(pool.values(layer)[:, start : start + n], v.T)
        and (not pool.value_rows or np.array_equal(pool.value_rows_of(layer)[start : start + n], v))
        for layer, (k, v) in enumerate(written)
    )


@pytest.fixture(params=["gemm", "flash", "auto"])
def attention(request, monkeypatch) -> str:
    """Each attention, set before the engine (and its pool's layout) is made."""
    monkeypatch.setattr(ggml_attention, "ATTENTION", request.param)
    return request.param


@pytest.mark.parametrize("gemm_from", [0, None, 16])  # lines only, rows only, both
def test_values_keep_their_cells_through_copies_moves_and_the_pools_growth(gemm_from):
    pool = CellPool(2, 2, 8, 64, gemm_from=gemm_from)
    a = pool.allocate(10)
    written = fill(pool, a, 10, seed=1)
    b = pool.allocate(12)
    pool.copy(a, b, 10)  # a prefix shared by a new request
    assert held(pool, b, written)
    c = pool.move(b, 12, 10, 30)  # a range outgrowing itself
    assert held(pool, c, written) and held(pool, a, written)
    pool.allocate(40)  # no room left: the pool doubles, every range where it was
    assert pool.generation == 1 and pool.cells == 128
    assert held(pool, a, written) and held(pool, c, written)
    assert not pool.values(0)[:, c + 10 :].any()  # the cells past what was written read as zeros
    pool.free()


def test_whole_pages_of_values_given_back_read_as_zeros_again_and_their_neighbours_stay():
    pool = CellPool(1, 1, 4, 2 * PAGE, gemm_from=0)  # every value element's line of cells: four pages of F16
    head = pool.allocate(100)
    big = pool.allocate(PAGE)  # two pages' worth of cells in every line, one whole page at least
    tail = pool.allocate(50)
    kept = [fill(pool, at, n, seed=at) for at, n in ((head, 100), (tail, 50))]
    fill(pool, big, PAGE, seed=2)
    pool.release(big, PAGE)
    first, last = -(-big * 2 // PAGE) * PAGE // 2, (big + PAGE) * 2 // PAGE * PAGE // 2  # the whole pages' cells
    assert last - first >= PAGE // 2
    assert not pool.values(0)[:, first:last].any()
    assert held(pool, head, kept[0]) and held(pool, tail, kept[1])
    pool.free()


def test_a_step_writes_each_rows_values_into_its_own_cells_and_nowhere_else(attention):
    e = smollm2(layers=2)
    assert e.pool.transposed == (attention != "flash") and e.pool.value_rows == (attention != "gemm")
    e.forward([StepInput("a", tokens=np.arange(30) + 100, max_positions=300)])
    e.forward([StepInput("b", tokens=np.arange(7) + 400, max_positions=300)])
    e.forward([StepInput("a", tokens=np.array([9])), StepInput("b", tokens=np.array([11]))])  # a decode step
    mine = np.zeros(e.pool.cells, dtype=bool)
    for rid, n in (("a", 31), ("b", 8)):
        start = e.caches[rid].start
        mine[start : start + n] = True
    for layer in range(2):  # the values in the layout their rows' attention reads (flash below gemm_from: rows)
        as_rows = e.pool.value_rows
        written = (e.pool.value_rows_of(layer) != 0).any(axis=1) if as_rows else (e.pool.values(layer) != 0).any(axis=0)
        assert written[mine].all() and not written[~mine][1:].any()  # cell 0: the padding rows' scratch
        assert np.array_equal(written, (keys(e.pool, layer) != 0).any(axis=1))  # the keys' rows, the same cells
        if as_rows and e.pool.transposed:
            assert not e.pool.values(layer).any()  # no matmul row attended them: the lines were never needed
    e.close()


def test_a_decode_steps_graph_copies_none_of_the_cells_it_attends(attention):
    """A lone row over a span of cells: its graph's copies (ggml_cont, ggml_cpy) are of its own rows, never of the
    span's values; transposing them each step made a matmul attention's decode row cost several times flash's."""
    e = smollm2(layers=2)
    e.forward([StepInput("r", tokens=np.arange(600) % 50 + 100, max_positions=1100)])
    e.forward([StepInput("r", tokens=np.array([7]))])
    (graph,) = [gr for gr in e.graphs.graphs.values() if gr.shape.rows == 1]
    span = graph.shape.groups[0].cells
    assert span >= 1024
    assert graph.copied_bytes() < span * e.pool.row // 4  # a quarter of one layer's values in the span
    e.close()


def float_smollm2(layers: int) -> GgmlEngine:
    """SmolLM2's first layers with F16 weights: no activations quantized, so two attentions part by their own
    rounding only."""
    path = smollm2_path()
    cfg = dataclasses.replace(load_config(path), n_layers=layers)
    return GgmlEngine(path, Shard("m", 0, layers, layers), cfg, threads=1, quantize="f16", adapt_threads=False)


def test_the_default_attention_gives_llama_cpps_flash_attention_logits_but_for_rounding(monkeypatch):
    """Both read the values the pool keeps (flash attention a copy of them transposed back), so a value written to
    or read from the wrong cell would part them by far more than rounding: a prompt, decode steps past a range's
    move, and a second request beside the first."""
    prompt = np.random.default_rng(3).integers(100, 5000, 250)
    runs = []
    for attention in ("gemm", "flash"):
        monkeypatch.setattr(ggml_attention, "ATTENTION", attention)
        e = float_smollm2(layers=4)
        out = [e.forward([StepInput("a", tokens=prompt, max_positions=300)], all_logits=True)[0]]
        out.append(e.forward([StepInput("b", tokens=prompt[:20], max_positions=40)])[0])
        for k in range(10):  # "a" passes 256 positions: its range moves
            step = [StepInput("a", tokens=prompt[k : k + 1]), StepInput("b", tokens=prompt[k + 1 : k + 2])]
            out += e.forward(step)
        runs.append(np.concatenate(out))
        e.close()
    gemm, flash = runs
    # observed: 0.0011 of the logits' spread apart (at most 0.13 in logits of spread 7.6), the same top token at
    # every position; the same logits a position off (what values in a neighbour's cell would look like): 0.88
    assert relative_rms(gemm, flash) < ROUNDING
    assert clear_top1_disagreements(gemm, flash, margin=0.5)[0] == []


def test_with_matmul_attention_a_row_gets_the_same_numbers_in_a_prefill_in_chunks_decoding_or_beside_others(
    monkeypatch,
):
    """What exact replay and batching need of the "gemm" attention (tests/engines/test_ggml_invariance.py asks it
    of the default): a prompt at once, in uneven chunks and token by token, and a request decoding alone or beside
    others over a span of 1,024 cells and more, bit for bit."""
    monkeypatch.setattr(ggml_attention, "ATTENTION", "gemm")
    e = smollm2(layers=4)
    tokens = np.random.default_rng(7).integers(100, 5000, 100)
    whole = e.forward([StepInput("whole", tokens=tokens, max_positions=100)], all_logits=True)[0]
    cuts = [0, 1, 8, 41, 43, 99, 100]
    chunked = [
        e.forward([StepInput("chunked", tokens=tokens[a:b], max_positions=100)], all_logits=True)[0]
        for a, b in zip(cuts, cuts[1:])
    ]
    stepped = [e.forward([StepInput("steps", tokens=tokens[i : i + 1], max_positions=100)])[0] for i in range(40)]
    assert np.array_equal(np.concatenate(chunked), whole) and np.array_equal(np.concatenate(stepped), whole[:40])
    e.forward([StepInput("lone", tokens=tokens[:99], max_positions=1100)])
    e.caches["lone"].grow(1100)  # a range of 1,100 cells: the lone row's span passes 1,024
    lone = e.forward([StepInput("lone", tokens=tokens[99:])])[0]
    e.forward([StepInput("busy", tokens=tokens[:99], max_positions=1100), StepInput("x", tokens=tokens[:9])])
    beside = e.forward([StepInput("x", tokens=tokens[9:10]), StepInput("busy", tokens=tokens[99:])])[1]
    assert np.array_equal(lone, whole[-1:]) and np.array_equal(beside, whole[-1:])
    e.close()


def test_with_matmul_attention_a_lone_row_is_computed_once_not_beside_a_copy_of_itself(monkeypatch):
    """A matmul over one row would take vec_dot, which sums otherwise than a batch's tinyBLAS: a lone decode row's
    heads that share a kv head are its matmuls' rows (attention.py), so each layer's two attention matmuls (F16 keys
    and values) take one row per head, not the row and a copy (the numbers: the test above, token by token)."""
    monkeypatch.setattr(ggml_attention, "ATTENTION", "gemm")
    e = smollm2(layers=4)
    e.forward([StepInput("lone", tokens=np.arange(100, 140), max_positions=100)])
    step = [StepInput("lone", tokens=np.array([7]))]
    shape = e.runner.shape(e.pack(step), [e.caches["lone"]], False)
    e.forward(step)
    graph = e.runner.graphs.get(shape)
    attend = [n for n in graph_ops(graph.gf, graph.nodes, g.GGML_OP_MUL_MAT) if n.src[0].contents.type == F16]
    assert [n.src[1].contents.ne[1] * n.src[1].contents.ne[2] for n in attend] == [e.config.n_heads] * 8
    e.close()


def test_each_position_attends_by_the_kernel_its_position_takes_in_any_step(monkeypatch):
    """Under "auto" a row below the pool's gemm_from attends by flash attention and one from it by matmuls, however
    the step that computes it is made: a prompt across the boundary at once, in chunks that straddle it, token by
    token, and beside another request; below the boundary the logits are flash attention's own, bit for bit."""
    monkeypatch.setattr(ggml_attention, "GEMM_FROM", 40)
    tokens = np.random.default_rng(11).integers(100, 5000, 100)
    monkeypatch.setattr(ggml_attention, "ATTENTION", "flash")
    e = smollm2(layers=4)
    flash = e.forward([StepInput("r", tokens=tokens, max_positions=100)], all_logits=True)[0]
    e.close()
    monkeypatch.setattr(ggml_attention, "ATTENTION", "auto")
    e = smollm2(layers=4)
    assert e.pool.gemm_from == 40
    whole = e.forward([StepInput("whole", tokens=tokens, max_positions=100)], all_logits=True)[0]
    assert np.array_equal(whole[:40], flash[:40]) and not np.array_equal(whole[40:], flash[40:])
    cuts = [0, 1, 8, 39, 41, 43, 99, 100]
    chunked = [
        e.forward([StepInput("chunked", tokens=tokens[a:b], max_positions=100)], all_logits=True)[0]
        for a, b in zip(cuts, cuts[1:])
    ]
    assert np.array_equal(np.concatenate(chunked), whole)
    e.forward([StepInput("steps", tokens=tokens[:35], max_positions=100)])
    stepped = [e.forward([StepInput("steps", tokens=tokens[i : i + 1])])[0] for i in range(35, 50)]
    assert np.array_equal(np.concatenate(stepped), whole[35:50])
    e.forward([StepInput("x", tokens=tokens[:30], max_positions=100)])
    e.forward([StepInput("y", tokens=tokens[:60], max_positions=100)])
    beside = e.forward(  # one request below the boundary, one crossing it, one past it: three groups, one step
        [
            StepInput("x", tokens=tokens[30:31]),
            StepInput("y", tokens=tokens[60:62]),
            StepInput("steps", tokens=tokens[50:51]),
        ],
        all_logits=True,
    )
    assert np.array_equal(beside[0], whole[30:31]) and np.array_equal(beside[1], whole[60:62])
    assert np.array_equal(beside[2], whole[50:51])
    crossing = e.forward([StepInput("z", tokens=tokens[:38], max_positions=100)])  # then 4 rows across 40, beside x
    crossing = e.forward([StepInput("z", tokens=tokens[38:42]), StepInput("x", tokens=tokens[31:32])], all_logits=True)
    assert np.array_equal(crossing[0], whole[38:42]) and np.array_equal(crossing[1], whole[31:32])
    # back below the boundary (rejected proposals), then other tokens: positions 33-39 rewritten in rows only
    e.rollback("steps", 33)
    other = np.concatenate([tokens[:33], tokens[50:67]])
    again = [e.forward([StepInput("steps", tokens=other[i : i + 1])])[0] for i in range(33, 50)]
    fresh = e.forward([StepInput("fresh", tokens=other, max_positions=100)], all_logits=True)[0]
    assert np.array_equal(np.concatenate(again), fresh[33:50])
    e.close()


def resident_line_pages(pool: CellPool) -> int:
    """Pages of the pool's transposed values backed by memory now (mincore)."""
    libc, total = ctypes.CDLL(None, use_errno=True), 0
    for t in pool.v_lines:
        first = t.contents.data // PAGE * PAGE
        n = -(-(t.contents.data + pool.cells * pool.width * 2 - first) // PAGE)
        vec = (ctypes.c_ubyte * n)()
        assert libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(n * PAGE), vec) == 0
        total += sum(b & 1 for b in vec)
    return total


@pytest.mark.parametrize("gemm_from", [1024, 16])  # the prompt's rows all flash; its last 24 by matmuls
def test_a_prefix_is_copied_with_the_values_lines_only_where_they_were_written(monkeypatch, gemm_from):
    """A request taking over another's first positions gets their keys and value rows, and their lines where they
    hold values (a matmul row wrote or attended them). Lines no matmul row ever needed were never written, and
    copying them anyway wrote a page of every value element's line in every layer, tens of MB for a 7B-shaped shard,
    for a few cells. Either way the copy computes what a fresh prompt does."""
    monkeypatch.setattr(ggml_attention, "GEMM_FROM", gemm_from)
    e = smollm2(layers=2)  # under "auto": values as rows and in lines
    assert e.pool.value_rows and e.pool.transposed and e.pool.gemm_from == gemm_from
    e.retained.limit = 1 << 30
    prompt = np.arange(40) % 50 + 100
    (alone,) = e.forward([StepInput("a", tokens=prompt, max_positions=64)])
    e.retain("a")
    pages = resident_line_pages(e.pool)
    assert e.resume("b", "a", 32)  # a part of its cache: copied, "a" stays retained
    if gemm_from > len(prompt):  # lines never written: none copied
        assert resident_line_pages(e.pool) == pages
    (resumed,) = e.forward([StepInput("b", tokens=prompt[32:], max_positions=64)])
    np.testing.assert_array_equal(resumed[-1], alone[-1])
    e.close()


def test_the_pools_growth_copies_the_values_lines_only_as_far_as_any_were_written():
    """Ranges of flash rows write keys and value rows only; when the pool doubles, copying every used cell's lines
    anyway wrote a page of every value element's line in every layer (46 MB for SmolLM2's 30 layers). Lines that were
    written move with their cells, as before."""
    pool = CellPool(2, 2, 8, 4 * PAGE, gemm_from=16)  # values as rows and in lines
    a = pool.allocate(PAGE)
    for layer in range(2):
        keys(pool, layer)[a : a + PAGE] = 1.0
        pool.value_rows_of(layer)[a : a + PAGE] = 2.0
    pool.allocate(4 * PAGE)  # no room: the pool doubles
    assert pool.generation == 1 and resident_line_pages(pool) == 0
    assert (keys(pool, 1)[a : a + PAGE] == 1.0).all() and (pool.value_rows_of(1)[a : a + PAGE] == 2.0).all()
    written = fill(pool, a, 100, seed=3)  # lines too, now
    pool.allocate(8 * PAGE)
    assert pool.generation == 2 and held(pool, a, written) and resident_line_pages(pool) > 0
    pool.free()


def peak_rise_kb(action) -> int:
    """How far this process's peak resident memory rose above what it held before `action` (kB): the peak is reset
    first (Linux's clear_refs 5)."""
    status = lambda key: int(next(x for x in open("/proc/self/status") if x.startswith(key)).split()[1])  # noqa: E731
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    action()
    return status("VmHWM") - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's peak-RSS reset")
def test_the_pools_growth_holds_the_cells_in_use_once_and_one_tensor_twice():
    """When the pool doubles, each old tensor's pages go back as soon as it is copied: a long prompt that grew the
    pool of a 7B shard held its KV twice for the move otherwise (180 MB for 1,024 positions on 11 layers)."""
    pool = CellPool(8, 4, 128, 4096, gemm_from=None)  # 16 tensors of keys and value rows, 4 MB each when full
    a = pool.allocate(4000)
    for layer in range(8):
        keys(pool, layer)[a : a + 4000] = 1.0
        pool.value_rows_of(layer)[a : a + 4000] = 2.0
    in_use_kb = 16 * 4000 * pool.row // 1024
    rise = peak_rise_kb(lambda: pool.allocate(200))  # no room: the pool doubles
    assert pool.generation == 1 and (keys(pool, 7)[a : a + 4000] == 1.0).all()
    assert (pool.value_rows_of(7)[a : a + 4000] == 2.0).all()
    assert rise < in_use_kb // 4, (rise, in_use_kb)  # the moved cells, less what was given back as it went
    pool.free()


def test_the_attention_option_sets_the_kernel_by_position_as_the_module_default_does(monkeypatch):
    """`--attention` (the engine's `attention`) picks the pool's gemm_from per engine: "gemm" computes the logits the
    module's ATTENTION "gemm" does, bit for bit, and a bad name is refused before any weight loads."""
    path = smollm2_path()
    cfg = dataclasses.replace(load_config(path), n_layers=2)
    shard, tokens = Shard("m", 0, 2, 2), np.random.default_rng(5).integers(100, 5000, 40)

    def run(**option) -> tuple[int | None, np.ndarray]:
        e = GgmlEngine(path, shard, cfg, threads=1, adapt_threads=False, **option)
        try:
            return e.pool.gemm_from, e.forward([StepInput("r", tokens=tokens, max_positions=40)], all_logits=True)[0]
        finally:
            e.close()

    assert run()[0] == ggml_attention.GEMM_FROM and run(attention="flash")[0] is None
    chosen, by_option = run(attention="gemm")
    monkeypatch.setattr(ggml_attention, "ATTENTION", "gemm")
    assert chosen == 0 and np.array_equal(by_option, run()[1])
    with pytest.raises(ValueError, match="--attention must be one of"):
        GgmlEngine(path, shard, cfg, attention="sideways")
