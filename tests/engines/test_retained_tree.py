"""The retained store's tree on real storage, position by position: whatever finished requests are kept, branched,
taken, evicted and dropped, a cache taken from an entry holds exactly the keys and values of that entry's first
positions (each position's numbers name the token it was computed for), every cache is freed once, and the store
stays within its limit. On numpy slabs; the ggml cell pool (with its value lines) and tinygrad assemble a chain too."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.engines.backend import RequestCache, SlabCache
from shards.engines.ggml.cells import CellPool, CellRange, tensor_array
from shards.engines.retained import RetainedCaches


def slab_cache(tokens: list[int]) -> RequestCache:
    """A one-layer numpy cache whose position p holds keys and values equal to tokens[p]."""
    layer = SlabCache(lambda shape: np.zeros(shape, np.float32), 1, 2)
    kv = np.repeat(np.asarray(tokens, np.float32), 2).reshape(len(tokens), 1, 2)
    layer.update_and_fetch(kv, -kv, 0)
    cache = RequestCache([layer])
    cache.commit(len(tokens))
    return cache


def slab_tokens(cache: RequestCache) -> list[int]:
    layer = cache.layers[0]
    k, v = layer.k[0, : cache.length, 0], layer.v[0, : cache.length, 0]
    assert np.array_equal(k, -v)
    return [int(t) for t in k]


def test_a_chain_taken_holds_its_positions_in_order():
    store = RetainedCaches(limit=1 << 20)
    root, branch = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9, 9]
    store.keep("root", slab_cache(root))
    store.keep("branch", slab_cache(branch))
    assert store.branch("branch", "root", 4) and store.caches["branch"].length == 3
    assert slab_tokens(store.take("branch", 6)) == branch[:6] and "branch" in store  # part: a copy
    assert slab_tokens(store.take("root", 3)) == root[:3]
    assert slab_tokens(store.take("branch", 7)) == branch and "branch" not in store  # a whole leaf: taken
    assert slab_tokens(store.take("root", 6)) == root and not store.caches


def test_tinygrad_caches_assemble_a_chain_too():
    from tinygrad import Tensor

    from shards.engines.tinygrad_engine import TinygradCache

    def cache(tokens: list[int]) -> RequestCache:
        layer = TinygradCache.empty(1, 2)
        kv = Tensor(np.repeat(np.asarray(tokens, np.float32), 2).reshape(len(tokens), 1, 2))
        layer.update_and_fetch(kv, -kv, 0)
        c = RequestCache([layer])
        c.commit(len(tokens))
        return c

    store = RetainedCaches(limit=1 << 30)
    store.keep("root", cache([1, 2, 3, 4, 5]))
    store.keep("branch", cache([1, 2, 3, 4, 8, 8]))
    assert store.branch("branch", "root", 4)
    got = store.take("branch", 6).layers[0].kv.numpy()[:, :6, 0, 0]
    assert got.tolist() == [[1, 2, 3, 4, 8, 8], [-1, -2, -3, -4, -8, -8]]


ops = st.lists(
    st.tuples(st.sampled_from(["keep", "take", "shrink", "drop"]), st.integers(0, 5), st.integers(1, 40)),
    max_size=30,
)


@settings(max_examples=120, deadline=None)
@given(ops)
def test_whatever_happens_a_taken_cache_holds_its_entrys_first_positions(steps):
    store, paths, made = RetainedCaches(limit=4000), {}, 0
    for what, pick, n in steps:
        held = list(store.caches)
        if what == "keep":
            # a new request: part of a held path (whole blocks of 4), then tokens of its own
            parent = held[pick % len(held)] if held else None
            shared = paths[parent][: (min(n, len(paths[parent])) // 4) * 4] if parent else []
            rid, made = f"r{made}", made + 1
            paths[rid] = shared + [100 + made] * (1 + n % 7)
            if store.keep(rid, slab_cache(paths[rid])) == [rid]:
                continue
            if parent in store and shared:
                store.branch(rid, parent, len(shared))
        elif what == "take" and held:
            rid = held[pick % len(held)]
            n = min(n, store.length(rid))
            assert slab_tokens(store.take(rid, n)) == paths[rid][:n]
        elif what == "shrink":
            store.shrink(store.nbytes // 2)
        elif what == "drop" and held:
            store.drop(held[pick % len(held)])
        for rid, (parent, at) in store.parents.items():
            assert parent in store and at <= store.length(parent) and paths[parent][:at] == paths[rid][:at]
        assert sum(store.children.values()) == len(store.parents) and store.nbytes <= store.limit


def key_rows(pool: CellPool) -> np.ndarray:
    """The first layer's keys, F16 [cells, width] (a view of the pool's memory)."""
    return tensor_array(pool.k[0], (pool.cells, pool.width))


def cell_cache(pool: CellPool, tokens: list[int]) -> CellRange:
    """A range whose position p holds tokens[p] in its keys, its value rows and, below `lines`, its value lines."""
    c = CellRange(pool, max(len(tokens), 16))
    for p, t in enumerate(tokens):
        key_rows(pool)[c.start + p] = t
        pool.value_rows_of(0)[c.start + p] = -t
        pool.values(0)[:, c.start + p] = -t
    c.commit(len(tokens))
    c.lines_valid = len(tokens)
    c.wrote_lines(len(tokens))
    return c


def scribble_free_cells(pool: CellPool) -> None:
    """Every free cell's keys and values overwritten, so a copy that missed a cell can't pass on what was there."""
    for start, end in pool.free_ranges:
        key_rows(pool)[start:end] = 999
        pool.value_rows_of(0)[start:end] = 999
        pool.values(0)[:, start:end] = 999


def test_the_cell_pool_assembles_a_chain_with_keys_value_rows_and_lines():
    pool = CellPool(1, 1, 8, 512, gemm_from=4)  # values both as rows and as lines
    store = RetainedCaches(limit=1 << 30)
    root, branch = list(range(1, 41)), list(range(1, 33)) + [77] * 9
    store.keep("root", cell_cache(pool, root))
    store.keep("branch", cell_cache(pool, branch))
    assert store.branch("branch", "root", 32) and store.caches["branch"].capacity == 9
    scribble_free_cells(pool)
    got = store.take("branch", 41)
    assert got.length == 41 and got.capacity >= 41 and got.lines_valid == 41
    cells = slice(got.start, got.start + 41)
    assert (key_rows(pool)[cells, 0] == np.float16(branch)).all()
    assert (pool.value_rows_of(0)[cells, 0] == -np.float16(branch)).all()
    assert (pool.values(0)[0, cells] == -np.float16(branch)).all()
    got.free()
    store.clear()
    assert pool.free_ranges == [(1, pool.cells)]
    pool.free()
