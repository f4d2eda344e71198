"""A GGUF tensor kept in its stored (possibly block-quantized) form, and the weight types exo-node accepts.

`gguf.quants` (llama.cpp's reference numpy code) does the dequantization. Every supported type stores a 2-D
weight row by row, each row a whole number of blocks along the input dimension, so permuting whole rows of the
raw bytes is exact: it is how the llama Q/K un-permutation is applied without dequantizing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# The low-bit types llama.cpp writes for common downloads (Q2_K/Q3_K_* and IQ* files, ternary TQ*, gpt-oss's MXFP4):
# ggml computes on each natively, and gguf.quants dequantizes each for the float engines.
LOW_BIT_TYPES = (
    Q.Q2_K,
    Q.Q3_K,
    Q.IQ4_NL,
    Q.IQ4_XS,
    Q.IQ3_XXS,
    Q.IQ3_S,
    Q.IQ2_XXS,
    Q.IQ2_XS,
    Q.IQ2_S,
    Q.IQ1_S,
    Q.IQ1_M,
    Q.TQ1_0,
    Q.TQ2_0,
    Q.MXFP4,
)
SUPPORTED_TYPES += LOW_BIT_TYPES


@dataclass(frozen=True)
class QuantizedTensor:
    """One weight as stored in the file.

    `shape` is the logical shape in Hugging Face order ([out_features, in_features] for a matrix); `data` is the raw
    bytes, [rows, bytes per row], read-only: a view of the memory-mapped file, or (after a row permutation) a copy.
    """

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.ggml_type][0]

    def dequantize(self) -> np.ndarray:
        """float32 array of `shape` (a fresh array, never a view of the file)."""
        if self.ggml_type == Q.F32:
            out = self.data.view(np.float32).copy()
        elif self.ggml_type == Q.BF16:  # gguf.quants' BF16 path is slower than a plain widening
            import ml_dtypes  # loaded for BF16 tensors only

            out = self.data.view(ml_dtypes.bfloat16).astype(np.float32)
        else:
            out = np.asarray(quants.dequantize(self.data, self.ggml_type), dtype=np.float32)
        return out.reshape(self.shape)

    def permute_rows(self, order: np.ndarray) -> QuantizedTensor:
        """Rows reordered (`new[i] = old[order[i]]`); exact for every type since rows are whole blocks. A 1-D tensor
        (a bias: one row of values in the file) has its elements reordered, as float32."""
        if len(self.shape) == 1:
            values = np.ascontiguousarray(self.dequantize()[order])
            values.flags.writeable = False
            return QuantizedTensor(self.name, Q.F32, self.shape, values.view(np.uint8).reshape(1, -1))
        data = np.ascontiguousarray(self.data[order])
        data.flags.writeable = False
        return QuantizedTensor(self.name, self.ggml_type, self.shape, data)


def unpermute_order(rows: int, n_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation for `llama`-architecture files.

    llama.cpp's converter regroups each head's rows from Hugging Face's rotate-half layout (first half of the head,
    then second half) into interleaved pairs, for its own rope kernel: per head, row 2j holds HF row j and row 2j+1
    holds HF row j + head_dim/2. So HF row r of head h (r < half) is file row 2r, and r >= half is 2(r - half) + 1.
    """
    head_dim = rows // n_heads
    half = head_dim // 2
    r = np.arange(head_dim)
    within = np.where(r < half, 2 * r, 2 * (r - half) + 1)
    return (np.arange(n_heads)[:, None] * head_dim + within[None, :]).reshape(-1)
