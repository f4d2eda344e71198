import pytest

from shards.model.shard import Shard


def test_first_and_last_flags():
    assert Shard("m", 0, 3, 6).is_first and not Shard("m", 0, 3, 6).is_last
    assert Shard("m", 3, 6, 6).is_last and not Shard("m", 3, 6, 6).is_first
    whole = Shard.whole("m", 6)
    assert whole.is_first and whole.is_last and whole.layer_count == 6


@pytest.mark.parametrize("start,end,n", [(-1, 2, 6), (3, 3, 6), (4, 2, 6), (0, 7, 6), (0, 0, 0)])
def test_invalid_ranges_are_rejected_with_a_clear_message(start, end, n):
    with pytest.raises(ValueError, match="0 <= start < end <= n_layers"):
        Shard("m", start, end, n)


def test_non_integer_bounds_are_rejected():
    with pytest.raises(ValueError, match="must be an int"):
        Shard("m", 0, 2.5, 6)


def test_shard_is_immutable_and_hashable():
    s = Shard("m", 0, 3, 6)
    with pytest.raises(AttributeError):
        s.start_layer = 1
    assert {s: 1}[Shard("m", 0, 3, 6)] == 1
