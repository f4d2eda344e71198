"""The one causal mask every engine uses (shards/engines/masks.py), in each engine's values."""

import numpy as np
import pytest

from shards.engines.masks import CausalMasks, allowed

CASES = [(0, 1, 256), (0, 7, 256), (250, 6, 256), (5, 3, 8), (1000, 1, 1024), (3, 4, 7), (2000, 2, 2100)]


def expected(start: int, length: int, span: int) -> np.ndarray:
    """Row i is position start+i: it sees cells 0..start+i and nothing beyond (later positions, padding)."""
    return np.arange(span)[None, :] <= (start + np.arange(length))[:, None]


@pytest.mark.parametrize("start,length,span", CASES)
def test_each_position_sees_itself_and_what_precedes_it(start, length, span):
    assert np.array_equal(CausalMasks(True, False, bool)(start, length, span), expected(start, length, span))
    f16 = CausalMasks(np.float16(0), np.float16(-np.inf), np.float16)(start, length, span)
    assert f16.dtype == np.float16 and f16.shape == (length, span)
    assert np.array_equal(f16 == 0, expected(start, length, span)) and np.all(np.isneginf(f16[f16 != 0]))


def test_one_ramp_serves_growing_requests_in_any_order():
    masks = CausalMasks(True, False, bool)
    for start, length, span in CASES[::-1] + CASES:
        assert np.array_equal(masks(start, length, span), expected(start, length, span))


def test_the_eager_mask_repeats_rows_for_each_query_head_of_a_group_and_a_single_position_needs_none():
    masks = CausalMasks(True, False, bool)
    assert allowed(masks, 9, 1, 3) is None
    m = allowed(masks, 2, 3, 2)
    assert m.shape == (1, 6, 5) and np.array_equal(m[0], np.tile(expected(2, 3, 5), (2, 1)))


def test_a_mask_of_nothing_is_refused():
    with pytest.raises(ValueError, match="length >= 1"):
        CausalMasks(True, False, bool)(0, 0, 4)


@pytest.mark.parametrize("window", [1, 5, 300])
@pytest.mark.parametrize("start,length,span", CASES)
def test_a_sliding_window_shows_each_row_its_last_window_cells_only(window, start, length, span):
    """Row p sees cells p-W+1 .. p (transformers' and llama.cpp's count), in every engine's values."""
    rows = (start + np.arange(length))[:, None]
    want = expected(start, length, span) & (np.arange(span)[None, :] > rows - window)
    assert np.array_equal(CausalMasks(True, False, bool, window=window)(start, length, span), want)
    f16 = CausalMasks(np.float16(0), np.float16(-np.inf), np.float16, window=window)(start, length, span)
    assert np.array_equal(f16 == 0, want) and np.all(np.isneginf(f16[f16 != 0]))


def test_a_single_position_past_the_window_needs_a_mask_and_one_within_it_none():
    masks = CausalMasks(True, False, bool, window=4)
    assert allowed(masks, 3, 1, 2) is None  # position 3 sees cells 0..3: all of them
    m = allowed(masks, 4, 1, 2)
    assert m.shape == (1, 2, 5) and m[0].tolist() == [[False, True, True, True, True]] * 2
