"""Whether the ggml a node loads sums F16 dot products in F32, as llama.cpp's does on every CPU.

ggml-python 0.0.45's ggml maps its F16 vector macros to F16 arithmetic wherever the compiler targets AVX512-FP16
(ggml-cpu/simd-mappings.h, `__AVX512FP16__`: -march=native on an Intel Xeon since Sapphire Rapids). Its F16 dot
product then sums in F16, in 128 lanes, and one of fewer than 128 elements (an attention head's, query by key, in
flash attention) falls to its scalar loop: attention runs at about half the speed, and rounds otherwise than
llama.cpp, whose newer ggml sums F16 dot products in F32 there. pyproject.toml builds ggml-python with the macro
undefined; a build without that (a plain `pip install ggml-python` on such a CPU) is found here, once per process,
and the engine says how to rebuild it.

The probe: one row of 8,192 elements, each weight F16's nearest to 0.1 (1,638 / 2^14) and each input 1. Summed in
F32 the dot product is exactly 819 (every partial sum, k x 1,638 / 2^14, fits F32's 24 bits); summed in F16 lanes,
each lane's 64 terms round at F16's spacing (2^-8 past 4), and the total comes out otherwise.
"""

from __future__ import annotations

import logging

import numpy as np

from shards.engines.ggml.lib import F16, F32, Context, compute_once, g

PROBE_N = 8192
PROBE_WEIGHT = float(np.float16(0.1))  # 1638 / 2**14
EXACT = PROBE_N * PROBE_WEIGHT  # 819.0: the F32 sum, exactly
REBUILD = (
    "rebuild ggml-python with the macro undefined, as exo-node's pyproject.toml has uv do: CMAKE_ARGS='-DGGML_LLAMAFILE=ON "
    "-DCMAKE_C_FLAGS=-U__AVX512FP16__ -DCMAKE_CXX_FLAGS=-U__AVX512FP16__' pip install --force-reinstall --no-deps "
    "--no-binary ggml-python ggml-python==0.0.45"
)
_verdict: list[float] = []
_warned: list[bool] = []


def f16_dot_sum() -> float:
    """The loaded ggml's F16 dot product of the probe row (computed once per process)."""
    if not _verdict:
        _verdict.append(_probe())
    return _verdict[0]


def sums_in_f32() -> bool:
    """The loaded ggml sums F16 dot products in F32 (see the module docstring)."""
    return f16_dot_sum() == EXACT


def warning() -> str | None:
    """What to tell the user when the loaded ggml sums F16 dot products in F16; None when it does not."""
    got = f16_dot_sum()
    if got == EXACT:
        return None
    return (
        f"this ggml sums F16 dot products in F16 (a probe's sum {got:g}, not {EXACT:g}): it was compiled for "
        f"AVX512-FP16 arithmetic, so attention runs at about half speed and rounds otherwise than llama.cpp; {REBUILD}"
    )


def warn_once(log: logging.Logger) -> None:
    """Log `warning()` the first time a process's engine loads a ggml that needs it."""
    if not _warned and (why := warning()):
        _warned.append(True)
        log.warning(why)


def _probe() -> float:
    weight = np.full((1, PROBE_N), PROBE_WEIGHT, np.float16)
    ctx = Context(4, graph=True)
    try:
        w, x = ctx.new(F16, (PROBE_N, 1)), ctx.new(F32, (PROBE_N, 1))
        ctx.room(1)
        y = g.ggml_mul_mat(ctx.ctx, w, x)  # one row: ggml's vec_dot, which llamafile's tinyBLAS leaves to it
        (out,) = compute_once(ctx, [(y, (1,))], [(w, weight), (x, np.ones((1, PROBE_N), np.float32))], "the F16 probe")
        return float(out[0])
    finally:
        ctx.free()
