"""The ggml a node loads sums F16 dot products in F32, as llama.cpp's does (shards/engines/ggml/f16_probe.py): on a CPU
with AVX512-FP16, ggml-python's ggml built without pyproject.toml's flags sums them in F16 lanes, halving attention's
speed and moving its numbers off llama.cpp's. The probe tells the two apart, and a node on such a build says how to
rebuild it."""

import logging

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.ggml import f16_probe  # noqa: E402


def f16_lanes(values: np.ndarray, lanes: int = 128) -> float:
    """ggml's F16 dot product under AVX512-FP16 (simd-mappings.h): 4 accumulators of 32 F16 lanes, each term added in
    F16, then the accumulators and the lanes added pairwise in F16."""
    acc = np.zeros(lanes, np.float16)
    for block in values.astype(np.float16).reshape(-1, lanes):
        acc = (acc.astype(np.float32) + block.astype(np.float32)).astype(np.float16)
    while len(acc) > 1:
        half = len(acc) // 2
        acc = (acc[:half].astype(np.float32) + acc[half:].astype(np.float32)).astype(np.float16)
    return float(acc[0])


def test_the_probe_row_sums_exactly_in_f32_and_otherwise_in_f16_lanes():
    terms = np.full(f16_probe.PROBE_N, f16_probe.PROBE_WEIGHT, np.float32)
    assert float(np.cumsum(terms, dtype=np.float32)[-1]) == f16_probe.EXACT == 819.0
    assert f16_lanes(terms) != f16_probe.EXACT


def test_the_loaded_ggml_sums_f16_dot_products_in_f32():
    assert f16_probe.sums_in_f32(), f16_probe.warning()
    assert f16_probe.warning() is None


def test_a_build_that_sums_in_f16_is_named_with_its_fix_once(monkeypatch, caplog):
    monkeypatch.setattr(f16_probe, "_verdict", [822.5])  # what the build without the flags gives on a Xeon
    monkeypatch.setattr(f16_probe, "_warned", [])
    log = logging.getLogger("test.f16")
    with caplog.at_level(logging.WARNING, logger="test.f16"):
        f16_probe.warn_once(log)
        f16_probe.warn_once(log)
    assert len(caplog.records) == 1
    text = caplog.records[0].getMessage()
    assert "822.5" in text and "-U__AVX512FP16__" in text and "--no-binary ggml-python" in text


def test_a_build_that_sums_in_f32_says_nothing(monkeypatch, caplog):
    monkeypatch.setattr(f16_probe, "_verdict", [f16_probe.EXACT])
    monkeypatch.setattr(f16_probe, "_warned", [])
    with caplog.at_level(logging.WARNING, logger="test.f16"):
        f16_probe.warn_once(logging.getLogger("test.f16"))
    assert not caplog.records
