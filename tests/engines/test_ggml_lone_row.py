"""A lone query row over SPLIT_KV_CELLS cells or more: ggml's CPU flash attention would split its cells across
threads and sum them in another order, so the backend lays the row's heads out as more rows (attention.py:
lone_row_attention). Whatever the heads' layout (grouped, a single kv head, one kv head per head), the row gets
bit for bit the numbers it gets beside another row, and the op reads it once, not beside a copy of itself."""

import ctypes

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.ggml.attention import SPLIT_KV_CELLS
from shards.engines.ggml.backend import GgmlBackend
from shards.engines.ggml.lib import F16, F32, Context, g
from shards.formats.config import ModelConfig
from tests.support.ggml_graph import computed
from tests.support.models import FIXTURES

HD = 32


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 1), (4, 4)])
def test_a_lone_row_over_many_cells_gets_its_numbers_beside_another_row_and_is_read_once(heads, kv_heads):
    rng = np.random.default_rng(heads * 10 + kv_heads)
    cells = SPLIT_KV_CELLS + 64
    q = rng.standard_normal((2, heads, HD)).astype(np.float32)
    kv = [rng.standard_normal((kv_heads, cells, HD)).astype(np.float16) for _ in range(2)]
    mask = np.zeros((2, cells), np.float16)
    mask[:, rng.random(cells) < 0.3] = -np.inf  # cells of other requests
    mask[:, 0] = 0
    ops = GgmlBackend(ModelConfig.from_dir(FIXTURES / "llama"), 1)
    backend = g.ggml_backend_cpu_init()
    g.ggml_backend_cpu_set_n_threads(backend, 2)
    ctx = ops.ctx = Context(64, graph=True)
    try:
        qi, mi = ops.input(F32, q.shape), ops.input(F16, mask.shape)
        ki, vi = ops.input(F16, kv[0].shape), ops.input(F16, kv[1].shape)
        pair = ops.flash_attention(qi, ki, vi, mi, 0.125)
        lone = ops.flash_attention(qi[0:1], ki, vi, mi[0:1], 0.125)
        with computed(ctx, backend, [pair, lone], [(qi, q), (ki, kv[0]), (vi, kv[1]), (mi, mask)]):
            assert np.array_equal(ops.to_numpy(lone), ops.to_numpy(pair)[:1])
        flash = [t for t in _sources(lone.t) if t.op == g.GGML_OP_FLASH_ATTN_EXT]
        assert [int(np.prod(list(t.src[0].contents.ne))) // HD for t in flash] == [heads]  # query rows x heads
    finally:
        ctx.free()
        ops.free()
        g.ggml_backend_free(backend)


def _sources(t) -> list:
    """The tensors `t` (a ggml tensor pointer) is computed from, itself included, each once."""
    seen: dict[int, object] = {}
    todo = [t]
    while todo:
        p = todo.pop()
        if p and ctypes.addressof(p.contents) not in seen:
            seen[ctypes.addressof(p.contents)] = p.contents
            todo += [s for s in p.contents.src if s]
    return list(seen.values())
