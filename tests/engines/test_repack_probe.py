"""A weight type goes into CPU_REPACK only where its interleaved kernels give a row the same bits alone and among
other rows, or where its gemm does with every step's rows padded to a multiple of four (a projection's:
shards/engines/ggml/repack_probe.py): each probe's verdict for each type this CPU can repack is what the kernels do
on another shape, other values and another batch, measured here by forcing the weight in."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.ggml import weight_placement  # noqa: E402
from shards.engines.ggml.lib import repack_supported  # noqa: E402
from shards.engines.ggml.repack_probe import repack_keeps_rows, repack_pads_rows  # noqa: E402
from tests.engines.test_ggml_engine import as_type, run_ops  # noqa: E402

CANDIDATES = [Q.Q4_0, Q.Q4_K, Q.IQ4_NL, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q5_K, Q.Q6_K]


def lone_and_batched_rows_agree(qt, rows: np.ndarray) -> tuple[bool, dict]:
    """Row 0 multiplied alone, and as the first and last of the 9 rows (4+4 through a gemm, the ninth alone)."""
    batch = np.concatenate([rows, rows[:1]])
    alone, _, repacked = run_ops(qt, rows[:1], np.zeros(1, np.int32))
    together, _, _ = run_ops(qt, batch, np.zeros(1, np.int32))
    return np.array_equal(alone[0], together[0]) and np.array_equal(alone[0], together[-1]), repacked


@pytest.mark.parametrize("ggml_type", CANDIDATES, ids=lambda t: t.name)
def test_the_probes_verdict_is_what_the_repacked_kernels_do_on_another_shape(ggml_type, monkeypatch):
    if not repack_supported(int(ggml_type), (2048, 128)):
        pytest.skip(f"CPU_REPACK has no {ggml_type.name} kernel on this CPU")
    rng = np.random.default_rng(int(ggml_type) + 7)
    qt = as_type(rng.standard_normal((128, 2048), dtype=np.float32), ggml_type)
    monkeypatch.setattr(weight_placement, "repack_keeps_rows", lambda t: True)  # forced into CPU_REPACK
    agree, repacked = lone_and_batched_rows_agree(qt, rng.standard_normal((8, 2048), dtype=np.float32))
    assert repacked == {ggml_type.name: 1}
    assert repack_keeps_rows(int(ggml_type)) == agree


@pytest.mark.parametrize("ggml_type", CANDIDATES, ids=lambda t: t.name)
def test_as_placed_a_weight_of_any_type_gives_a_row_the_same_bits_alone_and_batched(ggml_type):
    rng = np.random.default_rng(int(ggml_type))
    qt = as_type(rng.standard_normal((128, 2048), dtype=np.float32), ggml_type)
    agree, repacked = lone_and_batched_rows_agree(qt, rng.standard_normal((8, 2048), dtype=np.float32))
    assert agree and (repacked != {}) == (repack_keeps_rows(int(ggml_type)) or repack_pads_rows(int(ggml_type)))


@pytest.mark.parametrize("ggml_type", CANDIDATES, ids=lambda t: t.name)
def test_the_padded_probes_verdict_is_what_the_repacked_gemm_does_on_another_shape(ggml_type, monkeypatch):
    if not repack_supported(int(ggml_type), (2048, 128)):
        pytest.skip(f"CPU_REPACK has no {ggml_type.name} kernel on this CPU")
    rng = np.random.default_rng(int(ggml_type) + 11)
    qt = as_type(rng.standard_normal((128, 2048), dtype=np.float32), ggml_type)
    verdict = repack_pads_rows(int(ggml_type))
    monkeypatch.setattr(weight_placement, "repack_keeps_rows", lambda t: False)  # forced in, rows padded
    monkeypatch.setattr(weight_placement, "repack_pads_rows", lambda t: True)
    agree, repacked = lone_and_batched_rows_agree(qt, rng.standard_normal((8, 2048), dtype=np.float32))
    assert repacked == {ggml_type.name: 1}
    assert verdict == agree


def test_the_repack_rows_benchmark_says_what_the_probe_says():
    """bench/ggml_repack_rows.py's verdicts, which docs/benchmarks.md quotes: plain memory gives a row its own bits at
    every count; in CPU_REPACK a row read by the gemv (fewer than 4 rows) has them too, one read by the gemm (a
    multiple of 4) has them exactly where the probe lets the type in, and always has what it gets padded to four."""
    from bench.ggml_repack_rows import measure

    if not repack_supported(int(Q.Q4_K), (512, 64)):
        pytest.skip("CPU_REPACK has no Q4_K kernel on this CPU")
    results = measure(int(Q.Q4_K), (64, 512), [1, 3, 4, 8], threads=1, repeats=1)
    assert [(r["layout"], r["rows"]) for r in results] == [
        (lay, n) for lay in ("plain", "CPU_REPACK") for n in (1, 3, 4, 8)
    ]
    plain = [r for r in results if r["layout"] == "plain"]
    assert all(r["first_as_alone"] and r["last_as_alone"] for r in plain)
    repacked = {r["rows"]: r for r in results if r["layout"] == "CPU_REPACK"}
    assert all(repacked[n]["first_as_alone"] and repacked[n]["last_as_alone"] for n in (1, 3))
    keeps = repack_keeps_rows(int(Q.Q4_K))
    assert all(repacked[n]["first_as_alone"] == repacked[n]["last_as_alone"] == keeps for n in (4, 8))
    assert all(repacked[n]["first_as_padded"] and repacked[n]["last_as_padded"] for n in (4, 8))
