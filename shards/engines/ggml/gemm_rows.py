"""Float-weight matmuls whose rows don't depend on the step: how the ggml engine keeps F16/F32 weights batch-invariant.

ggml's CPU matmul (ggml 0.15.3, as ggml-python 0.0.45 bundles it) multiplies a float weight (F32, F16, BF16) by 2+ rows
with llamafile's tinyBLAS and by one row with vec_dot, which sums in another order (ggml-cpu.c
`ggml_compute_forward_mul_mat`, llamafile/sgemm.cpp): a row alone and the same row in a batch differ in the last bits,
so a replay that batches rows differently would not be exact. tinyBLAS sums each output in one order whatever its tile
or thread. Quantized weights are quant_rows.py's: a Q8_0-family weight's steps go by vec_dot where that is faster
with the same bits, or where only vec_dot gives a row its lone bits (IQ4_NL in plain memory).
- `pad` (the default): a step under MIN_FLOAT_ROWS rows gets zero rows, their outputs dropped: every row takes tinyBLAS.
- `rowwise`: 2+ rows go to ggml converted to the weight's dot-product type and strided, which tinyBLAS declines: every
  row takes vec_dot, as a lone row does (tests/engines/test_ggml_invariance.py checks F16 and F32, not BF16).
- `fast`: ggml's own choice per step; not batch-invariant on float weights.
Shapes tinyBLAS declines anyway take vec_dot at every step. ARM's tinyBLAS declines F16 steps under 8 rows (sgemm.cpp),
so `pad` pads to 8 there; a ggml built without llamafile (pyproject.toml turns it on) takes vec_dot for every step.
Which rows differ, and what each mode costs: docs/benchmarks.md, "Batch-invariant float weights".
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
