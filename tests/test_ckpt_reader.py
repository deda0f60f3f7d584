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


def test_a_local_shard_is_read_in_spans_that_overlap_its_checks(tmp_path, monkeypatch):
    import torch

    import ckpt
    from ckpt.loading.reader import MIN_LOCAL_SPAN_BYTES, ShardReader, local_span_bytes

    assert local_span_bytes(1 << 20) == MIN_LOCAL_SPAN_BYTES
    assert local_span_bytes(80 << 20) == 10 << 20
    assert local_span_bytes(4 << 30) == 64 << 20
    # 16 MB in 16 tensors: one rank's shard under the 64 MB cap, read in 4 MB spans.
    state = {"w": {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(16)}}
    ckpt.save(state, str(tmp_path), 1)
    spans = []
    real = ShardReader._read_span

    def counted(self, path, start, end):
        spans.append(end - start)
        return real(self, path, start, end)

    monkeypatch.setattr(ShardReader, "_read_span", counted)
    target = {"w": {k: torch.zeros_like(v) for k, v in state["w"].items()}}
    ckpt.load(target, str(tmp_path))
    assert len(spans) >= 4 and max(spans) <= MIN_LOCAL_SPAN_BYTES + (1 << 20)
    assert all(torch.equal(target["w"][k], v) for k, v in state["w"].items())
