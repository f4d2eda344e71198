"""How close each engine must come to the reference, and what replaces token-for-token greedy equality for engines
whose math is approximate.

Float engines (numpy, tinygrad, mlx) compute in float32 throughout: logits within 1e-4 of transformers (observed
<= 1e-5) and identical greedy tokens.

ggml, on float32 checkpoints (--quantize none, so weights stay float32), caches keys and values in F16 and rounds
queries to F16 for Q.K inside flash attention, as llama.cpp does: every cached value carries a relative rounding
error of up to 2^-11. After the fixtures' 6 layers the logits (magnitude <= 5) differ from transformers' by at most
0.018 (observed, llama/qwen2/qwen3): the bound is 0.05.

ggml on block-quantized weights also quantizes the activations before each quantized matmul (to 8 bits per block
of 32 or 256 values: q8_0/q8_1/q8_K, llama.cpp's kernels), a relative error of ~0.5% per matmul that compounds over
the ~7 matmuls of each layer. On the random GGUF fixtures (every supported weight type) the RMS difference from the
float32 reference is 2.6-4.0% of the logits' spread (observed): the bound is 8%.

The same positions computed in different groupings (a prompt in chunks or whole, a request alone or in a batch) are
bit-identical for the numpy engine (within 1e-5). ggml's F32 matmuls (llamafile's tinyBLAS, as in llama.cpp) tile
by the number of rows, so the summation order, and with it the rounding, follows the grouping: observed up to
1.6e-3 (qwen3 fixture) after 6 layers; the bound is 1e-2.

An approximate engine may flip a near-tie, after which two greedy continuations part for good, so for it greedy
equality is replaced by teacher forcing: along the reference's token sequence, the engine's top token must be the
reference's wherever the reference's two best logits are more than twice the engine's bound apart.
"""

from __future__ import annotations

import numpy as np

LOGITS_ATOL = {"ggml": 0.05}
REGROUPED_ATOL = {"ggml": 1e-2}
QUANTIZED_RMS = 0.08  # RMS logit difference / std of the reference logits, quantized weights (ggml)


def exact(engine: str) -> bool:
    return engine not in LOGITS_ATOL


def atol(engine: str) -> float:
    return LOGITS_ATOL.get(engine, 1e-4)


def regrouped_atol(engine: str) -> float:
    return REGROUPED_ATOL.get(engine, 1e-5)


def relative_rms(logits: np.ndarray, reference: np.ndarray) -> float:
    return float(np.sqrt(np.mean((logits - reference) ** 2)) / reference.std())


def clear_top1_disagreements(logits: np.ndarray, reference: np.ndarray, margin: float) -> tuple[list[int], int]:
    """Positions where the reference's top token leads by more than `margin` but `logits` picks another, and how
    many positions were that clear."""
    top2 = np.sort(reference, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > margin
    wrong = clear & (logits.argmax(-1) != reference.argmax(-1))
    return np.flatnonzero(wrong).tolist(), int(clear.sum())
