"""The planner's one rule (half of an object or more: fetch it whole), over a grid and
against the cases each caller meets."""

from __future__ import annotations

import itertools

import pytest

from fastload.staging.planner import (
    RANGED_MIN_BYTES,
    fetch_whole,
    hold_reads,
    read_by_range,
    whole_or_ranges,
)


@pytest.mark.parametrize(("needed", "total"), list(itertools.product(range(0, 12), range(1, 12))))
def test_half_or_more_fetches_whole(needed: int, total: int) -> None:
    assert fetch_whole(needed, total) == (needed * 2 >= total)


def test_an_object_of_unknown_size_is_read_by_range() -> None:
    assert not fetch_whole(10**9, None)


def test_ranges_that_cover_half_a_file_become_the_file_in_first_needed_order() -> None:
    ranges = [("b", 0, 10), ("a", 0, 40), ("b", 50, 10), ("a", 40, 20), ("c", 0, 1)]
    keys, left = whole_or_ranges(ranges, {"a": 100, "b": 100, "c": None})
    assert keys == ["a"]  # 60 of 100 bytes
    assert left == [("b", 0, 10), ("b", 50, 10), ("c", 0, 1)]  # 20 of 100; unknown size


def test_a_range_asked_twice_counts_once() -> None:
    keys, left = whole_or_ranges([("a", 0, 30), ("a", 0, 30)], {"a": 100})
    assert (keys, left) == ([], [("a", 0, 30)])


def test_held_only_where_the_batch_reads_half_the_shard() -> None:
    assert hold_reads({"x": 3, "y": 2, "z": 5}, {"x": 6, "y": 5, "z": 5}) == {
        "x": 3,
        "y": 0,
        "z": 5,
    }


def test_a_large_shard_read_for_a_few_samples_goes_by_range() -> None:
    assert read_by_range(RANGED_MIN_BYTES, reads=1, shard_samples=100)
    assert not read_by_range(RANGED_MIN_BYTES - 1, reads=1, shard_samples=100)  # small
    assert not read_by_range(RANGED_MIN_BYTES, reads=50, shard_samples=100)  # half of it
    assert not read_by_range(None, reads=1, shard_samples=100)  # size unknown
