"""Attention of a step's rows over the cache's cells, as ggml graph nodes: ggml's flash attention in blocks that keep
every row on one kernel (llama.cpp's numbers, exact replay), or two F16 matmuls and a softmax over values kept
transposed. A mixin of GgmlBackend (shards/engines/ggml/backend.py), which supplies `node`, `wrap`, `view`, `concat`
and `contiguous`.

Which one a row takes is a function of its position alone (`gemm_from`): so whatever step computes a position (a
prompt in any chunks, decoding, a replay, a prefix taken over from another request) computes it with the same kernel,
and both kernels give a row the same numbers in any step. Flash attention below GEMM_FROM keeps llama.cpp's logits
bit for bit where prompts mostly are; past it the matmuls, whose cost per cell is a fraction of the one-row flash
kernel's, keep a long prompt's prefill per token near a short one's."""

from __future__ import annotations

from shards.engines.ggml.arrays import GArray, ValueLines, c_strides, expect
from shards.engines.ggml.gemm_rows import MIN_FLOAT_ROWS
from shards.engines.ggml.lib import g
from shards.engines.registry import ATTENTION_CHOICES

# How rows attend: "flash" (ggml_flash_attn_ext's one-row kernel: llama.cpp's attention, its logits bit for bit),
# "gemm" (two F16 matmuls and a softmax on values the pool keeps transposed: gemm_attention), a third of flash's
# work for a prompt's rows and less for a decode row past ~1k cells, but rounded otherwise than llama.cpp: enough to
# fail the agreement bounds of tests/engines/test_gguf_lowbit.py and test_moe.py on quantized activations; or "auto",
# flash for positions below GEMM_FROM and gemm from there (cells.py: values below it copied into lines when needed). Read
# when a pool (its values' layouts) is made.
ATTENTION = "auto"
ATTENTIONS = ATTENTION_CHOICES  # also a node flag, --attention (a machine whose flash kernel is slow: gemm)
GEMM_FROM = 1024  # under "auto", the first position attended by matmuls: about where they get cheaper than flash
ATTENTION_ROWS = 32  # query rows per flash-attention op: below the size where ggml's CPU kernel changes (see attention)
SPLIT_KV_CELLS = 512  # from this many cells on, ggml splits a single query row's cells across threads (ops.cpp)
SCORE_BYTES = 16 << 20  # matmul attention computes its F32 scores (and their softmax) for this much at a time at most
SCORE_ROWS = 48  # and for this many query rows at most: smaller blocks stay in cache (docs/benchmarks.md)


def score_block(cells: int, heads: int) -> int:
    """Query rows whose scores matmul attention computes in one block over `cells` cells with `heads` heads: at most
    SCORE_ROWS and SCORE_BYTES, at least MIN_FLOAT_ROWS. Any block gives a row the same numbers (gemm_attention)."""
    return max(MIN_FLOAT_ROWS, min(SCORE_ROWS, SCORE_BYTES // (cells * heads * 4)))


def gemm_from(attention: str | None = None) -> int | None:
    """The first position whose row attends by matmuls under `attention` (ATTENTION by default); None: none does."""
    attention = ATTENTION if attention is None else attention
    if attention not in ATTENTIONS:
        raise ValueError(f"ggml attention must be one of {', '.join(ATTENTIONS)}, not {attention!r}")
    return {"flash": None, "gemm": 0, "auto": GEMM_FROM}[attention]


class GgmlAttention:
    """The attention ops of the ggml backend (see the module docstring)."""

    def attention(
        self, q: GArray, keys: GArray, values: GArray, mask: GArray | None, scale: float, softcap: float | None = None
    ) -> GArray:
        """A step's rows attending: q [T, heads, hd] against keys [kv_heads, cells, hd] and values as the pool keeps
        them (F16 views, shards/engines/ggml/cells.py: ValueLines, or [kv_heads, cells, hd] like the keys), `mask`
        F16 [T, cells] (0 visible, -inf not). -> [T, heads*hd]. The values' layout says which: lines by matmuls
        (`gemm_attention`), rows by ggml's flash attention (`flash_attention`); the pool hands a step's group of rows
        the layout of the kernel their positions take (graph.py's PoolKV). Without a mask (no cache) lines are
        transposed for flash attention, a copy of the span."""
        if len(keys.shape) == 4:
            return self.strided_attention(q, keys, values, mask, scale, softcap)
        lines = isinstance(values, ValueLines)
        if lines and mask is not None:
            return self.gemm_attention(q, keys, values, mask, scale, softcap)
        if lines:
            nkv, hd, cells = values.shape
            t = self.node(g.ggml_cont, self.node(g.ggml_permute, values.t, 1, 0, 2, 3))
            values = self.wrap(t, (nkv, cells, hd))
        return self.flash_attention(q, keys, values, mask, scale, softcap)

    def gemm_attention(
        self, q: GArray, keys: GArray, values: GArray, mask: GArray, scale: float, softcap: float | None = None
    ) -> GArray:
        """softmax(q k^T * scale + mask) v as two F16 matmuls and a softmax, every row the same arithmetic whatever
        the step: tinyBLAS sums each score over hd and each output over the span's cells in one order per element,
        whatever its tile, thread or the rows beside it (one row would take vec_dot, gemm_rows.py: so a lone row's
        heads that share a kv head are its matmuls' rows, or with too few of them the row goes beside a copy of
        itself); the softmax sums a row in blocks of SIMD width from the span's start. Masked
        cells count exact zeros in both sums, so a row's numbers depend only on its own cells and where they fall
        in those blocks: ranges start on CELL_ALIGN cells (cells.py) and spans on WINDOW_STEP, so that is fixed by
        the position. Why not flash attention: its one-row kernel, the only one that is the same for a lone row
        and a prompt's rows, costs per cell several times what a matmul does, and a prompt's row attends every
        cell before it: a long prompt's prefill grew several-fold per token. The values are multiplied
        where the pool keeps them, transposed (each element's cells in one line): no step copies or transposes the
        span, which made a decode row cost several times flash's."""
        t, nh, hd = q.shape
        nkv, cells, khd = keys.shape
        expect(
            khd == hd and isinstance(values, ValueLines) and values.shape == (nkv, hd, cells) and nh % nkv == 0,
            f"attention: {q.shape}, {keys.shape}",
        )
        expect(mask.shape == (t, cells), f"attention: mask {mask.shape}")
        block = score_block(cells, nh)
        if t > block:  # in blocks of rows, not every row's scores (rows x cells x heads, F32) at once
            n = -(-t // block)
            bounds = [i * (t // n) + min(i, t % n) for i in range(n + 1)]
            return self.concat(
                [
                    self.gemm_attention(q[a:b], keys, values, mask[a:b], scale, softcap)
                    for a, b in zip(bounds, bounds[1:])
                ],
                axis=0,
            )
        r = nh // nkv
        if t == 1 and r >= MIN_FLOAT_ROWS:  # a lone row: the heads sharing a kv head are the matmuls' rows
            q3 = self.view(q, (nkv, r, hd), (r * q.strides[1], q.strides[1], q.strides[2]))  # ne [hd, r, kv_heads]
            out = self.scores_times_values(q3.t, keys, values, self.concat([mask] * r, axis=0), scale, softcap)
            return self.view(self.wrap(out, (nkv, r, hd)), (1, nh * hd), (nh * hd * 4, 4))  # heads in order
        rows = max(t, MIN_FLOAT_ROWS)
        if rows > t:  # copies of the rows: every row in tinyBLAS, none alone
            q = self.concat([q] * -(-rows // t), axis=0)[:rows]
            mask = self.concat([mask] * -(-rows // t), axis=0)[:rows]
        qp = self.node(g.ggml_permute, q.t, 0, 2, 1, 3)  # ne [hd, T, heads]; kv head h // (heads / kv_heads)
        out = self.scores_times_values(qp, keys, values, mask, scale, softcap)  # ne [hd, T, heads]
        out = self.node(g.ggml_cont, self.node(g.ggml_permute, out, 0, 2, 1, 3))  # ne [hd, heads, T]
        flat = self.view(self.wrap(out, (rows, nh, hd)), (rows, nh * hd), c_strides((rows, nh * hd), 4))
        return flat if rows == t else flat[:t]

    def scores_times_values(self, qm, keys: GArray, values: GArray, mask: GArray, scale: float, softcap: float | None):
        """softmax(qm k^T * scale + mask) v for `qm` ne [hd, rows, heads] (a head's rows: its matmul's), heads a
        multiple of kv_heads, `mask` [rows, cells] -> ne [hd, rows, heads]. Each score and output element is summed
        in one order whatever the rows beside it (tinyBLAS), so how the rows are laid out changes no number."""
        kq = self.node(g.ggml_mul_mat, keys.t, qm)  # ne [cells, rows, heads]; kv head h // (heads / kv_heads)
        if softcap:
            kq = self.node(g.ggml_scale, kq, scale / softcap)
            kq = self.node(g.ggml_scale, self.node(g.ggml_tanh, kq), softcap)
            scale = 1.0
        p = self.node(g.ggml_soft_max_ext, kq, self.contiguous(mask).t, scale, 0.0)
        return self.node(g.ggml_mul_mat, values.t, p)  # values ne [cells, hd, kv_heads], strided

    def flash_attention(
        self, q: GArray, keys: GArray, values: GArray, mask: GArray | None, scale: float, softcap: float | None = None
    ) -> GArray:
        """Flash attention of a step's rows: q [T, heads, hd] against keys/values [kv_heads, cells, hd] (F16 cache
        views), `mask` F16 [T, cells] (0 visible, -inf not: ggml skips -inf cells outright). -> [T, heads*hd]

        Every row's result is computed by one kernel, ggml's row-at-a-time online softmax, whatever the step: so
        a row's numbers are the same however its prompt was chunked, whatever runs beside it, and after a replay
        that prefills generated tokens. ggml's CPU flash attention takes two other kernels, which compute in
        another order (by up to 1.4 in SmolLM2's logits): a tiled one for 64 query rows and more (so rows go in
        balanced blocks of at most ATTENTION_ROWS), and one that splits the cells across threads for a single row
        over SPLIT_KV_CELLS cells and more (so a lone row's heads stand in for more rows, `lone_row_attention`, or
        with a single head in all the row is attended beside a copy of itself)."""
        t, nh, hd = q.shape
        nkv, cells, khd = keys.shape
        expect(khd == hd and values.shape == keys.shape and nh % nkv == 0, f"attention: {q.shape}, {keys.shape}")
        expect(mask is None or mask.shape == (t, cells), f"attention: mask {None if mask is None else mask.shape}")
        if t > ATTENTION_ROWS and mask is not None:
            n = -(-t // ATTENTION_ROWS)  # blocks of t//n or t//n + 1 rows: none below 16 (a lone row: see above)
            bounds = [i * (t // n) + min(i, t % n) for i in range(n + 1)]
            return self.concat(
                [
                    self.flash_attention(q[a:b], keys, values, mask[a:b], scale, softcap)
                    for a, b in zip(bounds, bounds[1:])
                ],
                axis=0,
            )
        if t == 1 and cells >= SPLIT_KV_CELLS and (nkv > 1 or 1 < nh <= ATTENTION_ROWS):
            return self.lone_row_attention(q, keys, values, mask, scale, softcap)
        if t == 1 and cells >= SPLIT_KV_CELLS:
            twice = self.flash_attention(
                self.concat([q, q], axis=0),
                keys,
                values,
                None if mask is None else self.concat([mask, mask], axis=0),
                scale,
                softcap,
            )
            return twice[:1]
        qp = self.node(g.ggml_permute, q.t, 0, 2, 1, 3)  # ne [hd, T, heads], what flash attention reads
        out = self.node(
            g.ggml_flash_attn_ext, qp, keys.t, values.t, None if mask is None else mask.t, scale, 0.0, softcap or 0.0
        )  # ne [hd, heads, T], contiguous
        return self.view(self.wrap(out, (t, nh, hd)), (t, nh * hd), c_strides((t, nh * hd), 4))

    def strided_attention(
        self, q: GArray, keys: GArray, values: GArray, mask: GArray, scale: float, softcap: float | None
    ) -> GArray:
        """Rows of different requests, each over its own range only: q [T, heads, hd] against keys and values
        [T, kv_heads, cells, hd] (row i's range, graph.py's strided group) and `mask` [T, cells]. The requests go in
        the flash op's fourth dimension (q ne [hd, 1, heads, T], the mask ne [cells, 1, 1, T]), as llama.cpp's
        per-slot streams do: one op, no row scanning its neighbours' cells. Each (row, head) is the row-at-a-time
        kernel over its own cells in order, masked ones skipped, so the numbers are those of any other step; T >= 2
        keeps ggml off its cell-splitting kernel (a single row with nothing in q's fourth dimension)."""
        t, nh, hd = q.shape
        _, nkv, cells, khd = keys.shape
        expect(
            t >= 2 and khd == hd and keys.shape == values.shape == (t, nkv, cells, hd) and nh % nkv == 0,
            f"strided attention: {q.shape}, {keys.shape}",
        )
        expect(mask.shape == (t, cells), f"strided attention: mask {mask.shape}")
        q4 = self.view(q, (t, nh, 1, hd), (q.strides[0], q.strides[1], q.strides[1], q.strides[2]))
        m4 = self.view(self.contiguous(mask), (t, 1, 1, cells), (cells * 2, cells * 2, cells * 2, 2))
        out = self.node(
            g.ggml_flash_attn_ext, q4.t, keys.t, values.t, m4.t, scale, 0.0, softcap or 0.0
        )  # ne [hd, heads, 1, T], contiguous
        return self.view(self.wrap(out, (t, 1, nh, hd)), (t, nh * hd), c_strides((t, nh * hd), 4))

    def lone_row_attention(
        self, q: GArray, keys: GArray, values: GArray, mask: GArray | None, scale: float, softcap: float | None
    ) -> GArray:
        """One row over SPLIT_KV_CELLS cells or more, by the row-at-a-time kernel, at the cost of one row: ggml
        takes its cell-splitting kernel only for a single row with nothing in q's fourth dimension. So the row's
        heads go there, one entry per kv head (q ne [hd, 1, heads/kv_heads, kv_heads], keys and values ne
        [hd, cells, 1, kv_heads]): a query head h = i2 + (heads/kv_heads) * i3 meets kv head i3 = h // (heads /
        kv_heads), as in the three-dimensional op. With a single kv head the heads are the op's rows instead (q ne
        [hd, heads, 1], the row's mask repeated; at most ATTENTION_ROWS of them: the tiled kernel's threshold is
        above). Either way ggml writes the output in head order, and the kernel computes each (row, head) the same
        way whatever the layout, so the row's numbers are those of any step."""
        _, nh, hd = q.shape
        nkv, cells, _ = keys.shape
        r, hs = nh // nkv, q.strides[1]
        if nkv == 1:  # ne [hd, heads, 1]; out ne [hd, 1, heads]
            q, out_shape = self.view(q, (1, nh, hd), (nh * hs, hs, q.strides[2])), (nh, 1, hd)
            mask = None if mask is None else self.concat([mask] * nh, axis=0)
        else:  # ne [hd, 1, r, kv_heads]; out ne [hd, r, 1, kv_heads]
            q, out_shape = self.view(q, (nkv, r, 1, hd), (r * hs, hs, q.strides[0], q.strides[2])), (nkv, 1, r, hd)
            keys, values = (
                self.view(x, (nkv, 1, cells, hd), (x.strides[0], x.strides[0], x.strides[1], x.strides[2]))
                for x in (keys, values)
            )
        out = self.node(
            g.ggml_flash_attn_ext, q.t, keys.t, values.t, None if mask is None else mask.t, scale, 0.0, softcap or 0.0
        )  # contiguous: the heads in order
        return self.view(self.wrap(out, out_shape), (1, nh * hd), (nh * hd * 4, 4))
