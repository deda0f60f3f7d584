"""The shard reader's grouping of items into ranged reads (pure)."""

from __future__ import annotations

import pytest

from ckpt.loading.reader import coalesce_extents

CASES = [
    # (extents, max_bytes, max_gap, expected ranges)
    ([], 100, 0, []),
    ([(0, 10)], 100, 0, [(0, 10, [0])]),
    ([(0, 10), (10, 5), (15, 5)], 100, 0, [(0, 20, [0, 1, 2])]),  # contiguous
    ([(0, 10), (12, 5)], 100, 0, [(0, 10, [0]), (12, 17, [1])]),  # a gap, none allowed
    ([(0, 10), (12, 5)], 100, 2, [(0, 17, [0, 1])]),  # a gap within max_gap
    ([(0, 10), (13, 5)], 100, 2, [(0, 10, [0]), (13, 18, [1])]),  # one byte too far
    ([(0, 10), (5, 10)], 100, 0, [(0, 15, [0, 1])]),  # overlapping
    ([(0, 10), (0, 10)], 100, 0, [(0, 10, [0, 1])]),  # one item read by two requests
    ([(0, 60), (60, 60)], 100, 0, [(0, 60, [0]), (60, 120, [1])]),  # max_bytes
    ([(0, 60), (70, 40)], 100, 50, [(0, 60, [0]), (70, 110, [1])]),  # max_bytes over a gap
    ([(0, 200)], 100, 0, [(0, 200, [0])]),  # an item larger than max_bytes: alone
]


@pytest.mark.parametrize(("extents", "max_bytes", "max_gap", "expected"), CASES)
def test_items_are_grouped_into_bounded_ranges_across_allowed_gaps(
    extents, max_bytes, max_gap, expected
):
    assert coalesce_extents(extents, max_bytes, max_gap) == expected
