"""The shared Llama block (shards/model/transformer.py) over ggml: every array operation adds a node to a ggml graph.

Running the shared `ShardModel` on this backend does not compute anything: it builds one compute graph for a whole
forward pass, which the engine (shards/engines/ggml/engine.py) allocates once and re-runs with new inputs. An array is a
`GArray`: a ggml tensor plus its shape in numpy order (ggml orders dimensions innermost first, `ne`, the reverse).

Weights keep their GGUF block types (placed by shards/engines/ggml/weight_placement.py: `fused_weight` concatenates raw
block rows when the parts share a type, and otherwise keeps them apart and concatenates their outputs); the embedding
table stays quantized (ggml_get_rows dequantizes the looked-up rows). Rotary embedding is ggml_rope_ext at the step's
positions (an input tensor: this backend's `rotary` is the positions themselves, and ggml computes the angles), in NEOX
mode (Hugging Face's rotate_half) for Hugging Face Q/K rows, in NORMAL mode for a llama GGUF's rows kept in
llama.cpp's order (shards/engines/ggml/weights.py says why); attention is ggml_flash_attn_ext, with
grouped-query heads native and a mask over the cache's cells. It implements the block's `Backend` and no more: the
eager primitives (`where`, `softmax`, caches in its arrays) are not part of a graph backend's contract.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

from shards.engines.backend import Backend
from shards.engines.ggml import quant_rows
from shards.engines.ggml.arrays import GArray, c_strides, expect, nocopy_strides
from shards.engines.ggml.attention import GgmlAttention
from shards.engines.ggml.gemm_rows import DEFAULT as FLOAT_MATMUL
from shards.engines.ggml.gemm_rows import plan
from shards.engines.ggml.gemma_ops import GemmaOps, SlidingRotary
from shards.engines.ggml.lib import F32, I32, Context, Tensor, g
from shards.engines.ggml.moe import GExperts, GgmlMoE
from shards.engines.ggml.weight_placement import GgmlWeights, GWeight
from shards.formats.config import ModelConfig


class GgmlBackend(GgmlWeights, GemmaOps, GgmlAttention, Backend, GgmlMoE):
    """Builds ggml graphs for the shared model. `ctx` is the context of the graph being built (set by the engine);
    weights live in their own context and CPU buffers for the backend's lifetime (placed by GgmlWeights,
    shards/engines/ggml/weight_placement.py)."""

    name = "ggml"

    def __init__(
        self,
        cfg: ModelConfig,
        n_layers: int,
        repack: bool = True,
        interleaved_rope: bool = False,
        *,
        float_matmul: str = FLOAT_MATMUL,
    ):
        # At most ~12 tensors per layer (q/k/v and gate/up as parts when their types differ, norms, biases, q/k
        # norms) plus embedding, norm, head and rope factors; MoE: router, 3 expert stacks, shared expert.
        super().__init__((24 if cfg.moe else 16) * n_layers + 8, repack)
        self.ctx: Context | None = None
        self.float_matmul = float_matmul  # how float weights stay batch-invariant (gemm_rows.py)
        self.vec_dot_route = True  # Q8_0-family steps by vec_dot where faster, or only exact (quant_rows.py)
        self.head_dim, self.theta = cfg.head_dim, cfg.rope.theta
        # Rotate-half pairs (i, i + hd/2) for Hugging Face's Q/K layout (NEOX mode); adjacent pairs (NORMAL) for
        # the Q/K rows of llama-architecture GGUF files left in llama.cpp's permuted order
        self.rope_mode = g.GGML_ROPE_TYPE_NORMAL if interleaved_rope else g.GGML_ROPE_TYPE_NEOX
        self.rope_ctx = cfg.rope.original_max_position_embeddings  # only used by YaRN, which is off (ext_factor 0)
        # Any scaling (linear, llama3) as per-pair frequency divisors: theta_i = pos * base^(-2i/d) / factor_i.
        default = 1.0 / (cfg.rope.theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim))
        factors = (default / np.asarray(cfg.rope.inv_freq(cfg.head_dim))).astype(np.float32)
        self.freq_factors = None if np.all(factors == 1.0) else self._upload(F32, factors.shape, [factors], "rope")
        self.local_rope = self.sliding_rope(cfg)  # Gemma 3's local layers rotate with their own base (gemma_ops.py)

    def loaded(self) -> None:
        """`GgmlWeights.loaded`, then the quantized-rows probe for the plain-memory types (quant_rows.py), now rather
        than in a request's first batched step."""
        super().loaded()
        if self.vec_dot_route:
            for ggml_type, k in sorted(self.plain_shapes):
                if quant_rows.candidate(ggml_type):
                    quant_rows.vec_dot_rows(ggml_type, k)

    def nbytes(self, x) -> int:
        return x.nbytes if isinstance(x, (GWeight, GExperts)) else int(g.ggml_nbytes(x.t))

    def to_numpy(self, x: GArray) -> np.ndarray:
        """An F32 tensor's values (after the graph holding it has been computed)."""
        out = np.empty(x.shape, dtype=np.float32)
        g.ggml_backend_tensor_get(x.t, out.ctypes.data, 0, out.nbytes)
        return out

    # -- graph nodes ----------------------------------------------------------------------------------------------
    def node(self, fn, *args) -> Tensor:
        self.ctx.room()
        return fn(self.ctx.ctx, *args)

    def wrap(self, t: Tensor, shape: tuple[int, ...]) -> GArray:
        return GArray(self, t, tuple(shape))

    def input(self, ggml_type: int, shape: tuple[int, ...]) -> GArray:
        """A tensor the engine fills before each run. Flagged output too, so the allocator never reuses its memory:
        a re-run sees the inputs as they were set, and an input unchanged between steps needs no new copy."""
        t = self.ctx.new(ggml_type, tuple(reversed(shape)))
        g.ggml_set_input(t)
        g.ggml_set_output(t)
        return self.wrap(t, shape)

    def view(self, x: GArray, shape: tuple[int, ...], strides: tuple[int, ...], offset: int = 0) -> GArray:
        ne, nb = list(reversed(shape)), list(reversed(strides))
        n = len(ne)
        if n == 1:
            t = self.node(g.ggml_view_1d, x.t, ne[0], offset)
        elif n == 2:
            t = self.node(g.ggml_view_2d, x.t, ne[0], ne[1], nb[1], offset)
        elif n == 3:
            t = self.node(g.ggml_view_3d, x.t, ne[0], ne[1], ne[2], nb[1], nb[2], offset)
        elif n == 4:
            t = self.node(g.ggml_view_4d, x.t, *ne, nb[1], nb[2], nb[3], offset)
        else:
            raise ValueError(f"ggml tensors have at most 4 dimensions, not {n}")
        return self.wrap(t, shape)

    def slice(self, x: GArray, key) -> GArray:
        """Basic slicing with unit steps (`x[a:b]`, `x[:, a:b]`): a view, no copy."""
        key = key if isinstance(key, tuple) else (key,)
        if len(key) > len(x.shape) or not all(isinstance(k, slice) for k in key):
            raise IndexError(f"GArray supports slices with unit steps only, got {key!r}")
        shape, strides, offset = list(x.shape), x.strides, 0
        for axis, k in enumerate(key):
            start, stop, step = k.indices(shape[axis])
            if step != 1 or stop <= start:
                raise IndexError(f"GArray slices must be non-empty with step 1, got {k!r}")
            offset += start * strides[axis]
            shape[axis] = stop - start
        return self.view(x, tuple(shape), strides, offset)

    def reshape(self, x: GArray, shape: tuple[int, ...]) -> GArray:
        shape = tuple(int(n) for n in shape)
        if -1 in shape:
            known = math.prod(n for n in shape if n != -1)
            shape = tuple(math.prod(x.shape) // known if n == -1 else n for n in shape)
        if math.prod(shape) != math.prod(x.shape):
            raise ValueError(f"cannot reshape {x.shape} into {shape}")
        strides = nocopy_strides(x.shape, x.strides, shape)
        if strides is None:  # no view can do it: copy to contiguous first
            x = self.wrap(self.node(g.ggml_cont, x.t), x.shape)
            strides = c_strides(shape, x.strides[-1])
        return self.view(x, shape, strides)

    def contiguous(self, x: GArray) -> GArray:
        if x.strides == c_strides(x.shape, x.strides[-1]):
            return x
        return self.wrap(self.node(g.ggml_cont, x.t), x.shape)

    def binary(self, fn, a: GArray, b: GArray) -> GArray:
        # ggml broadcasts b over a (b's dims divide a's); the shared block only ever adds/multiplies equal shapes or
        # a vector over rows, both of which this covers.
        if len(b.shape) > len(a.shape) or any(m % n for m, n in zip(reversed(a.shape), reversed(b.shape))):
            raise ValueError(f"cannot broadcast {b.shape} over {a.shape}")
        return self.wrap(self.node(fn, a.t, b.t), a.shape)

    # -- operations of the shared block -----------------------------------------------------------------------------
    def linear(self, x: GArray, w: GWeight, bias: GWeight | None = None) -> GArray:
        """x @ w.T (+ bias); a weight whose kernels keep a row's numbers only in whole groups of rows
        (`w.row_multiple`: CPU_REPACK's gemm, shards/engines/ggml/repack_probe.py) gets x with zero rows padded on,
        their outputs dropped."""
        expect(len(x.shape) == 2 and x.shape[1] == int(w.tensor.contents.ne[0]), f"linear: input {x.shape}")
        n = x.shape[0]
        if pad := -n % w.row_multiple:
            x = self.wrap(self.node(g.ggml_pad, self.contiguous(x).t, 0, pad, 0, 0), (n + pad, x.shape[1]))
        outs = [self.matmul(x, t, rows, ggml_type) for (t, rows), ggml_type in zip(w.parts, w.ggml_types)]
        y = outs[0] if len(outs) == 1 else self.concat(outs, axis=-1)
        if bias is not None:
            y = self.wrap(self.node(g.ggml_add, y.t, bias.tensor), y.shape)
        return y[:n] if pad else y

    def matmul(self, x: GArray, t: Tensor, rows: int, ggml_type: int) -> GArray:
        """x [n, in] times one weight tensor [rows, in], in a way that gives each row of a float weight the numbers
        it gets alone, beside others, or in a prefill (`float_matmul`, shards/engines/ggml/gemm_rows.py): zero rows
        padded on (their outputs dropped), or the rows handed over in the weight's type and strided. Steps of a few
        rows of a quantized weight in plain memory go by vec_dot where the probe found that faster and the same, and
        every step of 2+ rows where only vec_dot keeps a row's bits (shards/engines/ggml/quant_rows.py)."""
        n, k = x.shape
        how, pad = plan(ggml_type, n, self.float_matmul)
        if how == "plain" and self.vec_dot_route and n > 1 and quant_rows.candidate(ggml_type):
            if n <= quant_rows.vec_dot_rows(ggml_type, k) and ctypes.addressof(t.contents) not in self.in_repack:
                v = quant_rows.strided_rows(self.node, self.contiguous(x).t, k, n)
                return self.wrap(self.node(g.ggml_mul_mat, t, v), (n, rows))
        if how != "plain":
            x = self.contiguous(x)
        if how == "pad":
            padded = self.node(g.ggml_pad, x.t, 0, pad, 0, 0)
            return self.wrap(self.node(g.ggml_mul_mat, t, padded), (n + pad, rows))[:n]
        if how == "strided":
            wide = self.node(g.ggml_pad, x.t, 8, 0, 0, 0)  # [n, k + 8]: a gap after each row
            if ggml_type != F32:
                wide = self.node(g.ggml_cast, wide, ggml_type)
            x = self.wrap(self.node(g.ggml_view_2d, wide, k, n, wide.contents.nb[1], 0), (n, k))
        return self.wrap(self.node(g.ggml_mul_mat, t, x.t), (n, rows))

    def embedding(self, table: GWeight, ids: GArray) -> GArray:
        expect(len(ids.shape) == 1 and ids.t.contents.type == I32 and not table.repacked, f"embedding: {ids.shape}")
        width = int(table.tensor.contents.ne[0])
        return self.wrap(self.node(g.ggml_get_rows, table.tensor, ids.t), (ids.shape[0], width))

    def take_rows(self, x: GArray, rows: GArray) -> GArray:
        expect(len(x.shape) == 2 and len(rows.shape) == 1, f"take_rows: {x.shape} by {rows.shape}")
        return self.wrap(self.node(g.ggml_get_rows, x.t, rows.t), (rows.shape[0], *x.shape[1:]))

    def rms_norm(self, x: GArray, weight: GWeight, eps: float) -> GArray:
        expect(x.shape[-1] == weight.parts[0][1] and x.strides[-1] == 4, f"rms_norm: {x.shape}")
        normed = self.node(g.ggml_rms_norm, x.t, eps)
        return self.wrap(self.node(g.ggml_mul, normed, weight.tensor), x.shape)

    def silu(self, x: GArray) -> GArray:
        return self.wrap(self.node(g.ggml_silu, x.t), x.shape)

    def gated(self, gate_up: GArray, width: int, act: str) -> GArray:
        """ggml's fused GLU (ggml_swiglu, ggml_geglu: the first half of each row activated, times the second), the
        op llama.cpp's graphs use: the same float math as the activation then the product on the CPU, and one
        kernel on a device, whose activation kernels take only contiguous rows (a half-row view fell back to the
        CPU on CUDA, a copy each way per layer)."""
        rows, both = gate_up.shape
        if both != 2 * width or gate_up.strides[-1] != 4 or (rows > 1 and gate_up.strides[0] != both * 4):
            return super().gated(gate_up, width, act)
        fused = g.ggml_swiglu if act == "silu" else g.ggml_geglu
        return self.wrap(self.node(fused, gate_up.t), (rows, width))

    def concat(self, xs: list[GArray], axis: int) -> GArray:
        """Pairwise, as a balanced tree: n pieces cost log2(n) copies of each element, not n."""
        while len(xs) > 1:
            pairs = []
            for a, b in zip(xs[::2], xs[1::2]):
                ax = axis % len(a.shape)
                expect(
                    len(a.shape) == len(b.shape)
                    and all(m == n for i, (m, n) in enumerate(zip(a.shape, b.shape)) if i != ax),
                    f"concat: {a.shape} and {b.shape}",
                )
                shape = tuple(a.shape[i] + b.shape[i] if i == ax else a.shape[i] for i in range(len(a.shape)))
                pairs.append(self.wrap(self.node(g.ggml_concat, a.t, b.t, len(a.shape) - 1 - ax), shape))
            xs = pairs + ([xs[-1]] if len(xs) % 2 else [])
        return xs[0]

    def rotary(self, positions: GArray, inv_freq=None) -> GArray:
        """The positions (I32 [rows]) as they are: ggml_rope_ext computes the angles, from the frequencies and
        scaling this backend took from the model's config."""
        expect(len(positions.shape) == 1 and positions.t.contents.type == I32, f"rotary: {positions.shape}")
        return positions

    def rope(self, x: GArray, rotary: GArray | SlidingRotary) -> GArray:
        """Rotary embedding of x [N, heads, hd] (NEOX or NORMAL pairs, see __init__) at the rows' positions
        `rotary` (I32 [N], see `rotary`; a sliding-window layer's own base: gemma_ops.SlidingRotary)."""
        theta, factors = self.theta, self.freq_factors
        if isinstance(rotary, SlidingRotary):
            rotary, theta, factors = rotary.positions, rotary.theta, rotary.factors
        expect(len(x.shape) == 3 and x.shape[2] == self.head_dim and rotary.shape == (x.shape[0],), f"rope: {x.shape}")
        t = self.node(
            g.ggml_rope_ext,
            x.t,
            rotary.t,
            factors,
            self.head_dim,
            self.rope_mode,
            self.rope_ctx,
            theta,
            1.0,
            0.0,
            1.0,
            32.0,
            1.0,
        )
        return self.wrap(t, x.shape)
