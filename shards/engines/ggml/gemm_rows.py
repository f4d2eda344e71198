"""Float-weight matmuls whose rows don't depend on the step: how the ggml engine keeps F16/F32 weights batch-invariant.

ggml's CPU matmul (ggml-cpu.c `ggml_compute_forward_mul_mat`, ggml 0.15.3 as ggml-python 0.0.45 bundles it) computes
an F32, F16 or BF16 weight times a step of several rows with llamafile's tinyBLAS (llamafile/sgemm.cpp), and a step of
one row with its vec_dot kernel, which sums each dot product in another order. tinyBLAS keeps one vector accumulator
per output, filled over the inner dimension in the same order whatever tile the output falls in and whichever thread
computes it, so among steps of 2 rows and more a row's result is the same; a lone row's differs in the last bits
(1e-6 on one projection, up to 0.05 in SmolLM2's logits through 30 layers). Measured by `bench/ggml_matmul_rows.py`
on x86-64 (AVX2, FMA, F16C): F16, BF16 and F32 weights, batches of 1..70 rows, 1-4 threads: every row of every
batch of 2+ equals itself in a batch of 2, and differs from itself alone. Quantized weights (Q4_0, Q4_1, Q8_0, Q4_K) give a
row the same numbers alone and in any batch, so they need nothing. Two ways to give every row one kernel:

- `pad` (the default): a float weight gets at least MIN_FLOAT_ROWS rows, a shorter step padded with zero rows whose
  outputs are dropped: every row takes tinyBLAS. Prefill and batches run as ggml runs them; a 1-row step multiplies
  2 rows (measured 1.7x CPU per SmolLM2 F16 decode step at batch 1, under load: bench/bench_float_rows.py).
- `rowwise`: a step of 2+ rows is handed to ggml already converted to the weight's dot-product type (F16 for F16)
  and strided (each row followed by a gap), which tinyBLAS declines: every row takes the 1-row vec_dot kernel, with
  the same numbers as a lone row (ggml's F32->F16 copy rounds as its matmul's own conversion does; checked for F16
  and F32 by tests/engines/test_ggml_invariance.py, not for BF16). 1-row steps run as ggml runs them; prefill and
  batches cost more (measured: prefill x1.9, batch-8 decode +32%).
- `fast`: ggml's own choice per step; not batch-invariant on float weights.

Where tinyBLAS declines a shape anyway (an output count not a multiple of 4, an inner dimension not a multiple of
the vector width), every step takes vec_dot, and both modes are harmless. On ARM, tinyBLAS declines F16 steps under
8 rows and F32 steps under 4 (sgemm.cpp), so `pad` pads to 8 there (read from the sources; not measured on ARM). A
ggml built without llamafile (GGML_LLAMAFILE off; pyproject.toml turns it on) takes vec_dot for every step.
"""

from __future__ import annotations

import platform

from gguf import GGMLQuantizationType as Q

from shards.engines.ggml.lib import g
from shards.engines.registry import FLOAT_MATMUL_CHOICES

FLOAT_TYPES = frozenset(int(t) for t in (Q.F32, Q.F16, Q.BF16))
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
MIN_FLOAT_ROWS = (2 if X86 else 8) if g.ggml_cpu_has_llamafile() else 1
DEFAULT = "pad"
assert DEFAULT in FLOAT_MATMUL_CHOICES


def plan(ggml_type: int, rows: int, mode: str) -> tuple[str, int]:
    """How to multiply `rows` activation rows by a weight of `ggml_type` under `mode`: ("plain", 0), ("pad", rows
    to add) or ("strided", 0)."""
    if mode not in FLOAT_MATMUL_CHOICES:
        raise ValueError(f"float matmul mode must be one of {', '.join(FLOAT_MATMUL_CHOICES)}, not {mode!r}")
    if int(ggml_type) not in FLOAT_TYPES or mode == "fast":
        return "plain", 0
    if mode == "pad":
        return ("pad", MIN_FLOAT_ROWS - rows) if rows < MIN_FLOAT_ROWS else ("plain", 0)
    return ("strided", 0) if rows > 1 else ("plain", 0)
