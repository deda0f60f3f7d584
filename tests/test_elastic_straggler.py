"""Straggler detection: the pure rule and the single-process monitor.

The monitor's all_gather across real ranks is exercised in test_elastic_collectives.py.
"""

from __future__ import annotations

import math

import pytest

from elastic.straggler import StragglerMonitor, find_stragglers


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("times", "factor", "expected"),
    [
        ([], 1.5, []),
        ([1.0], 1.5, []),
        ([1.0, 1.0, 1.0, 1.0], 1.5, []),
        ([1.0, 1.0, 1.0, 2.0], 1.5, [3]),
        ([1.0, 1.0, 1.5, 1.0], 1.5, []),  # equal to factor * median is not slower
        ([3.0, 1.0, 1.0, 1.0, 2.0], 1.5, [0, 4]),
        ([1.0, 1.2, 0.9], 1.1, [1]),
        ([0.1, 0.6], 1.5, [1]),  # median of two is their mean
        ([1.0, math.nan, 1.0], 1.5, [1]),  # a rank with no timing is reported
        ([math.inf, math.inf], 2.0, [0, 1]),
        ([0.0, 0.0, 0.0], 1.5, []),
    ],
)
def test_find_stragglers(times: list[float], factor: float, expected: list[int]) -> None:
    assert find_stragglers(times, factor) == expected


@pytest.mark.timeout(30)
@pytest.mark.parametrize("factor", [0.0, -1.0, math.nan, math.inf])
def test_find_stragglers_rejects_bad_factor(factor: float) -> None:
    with pytest.raises(ValueError, match="factor"):
        find_stragglers([1.0], factor)


@pytest.mark.timeout(30)
def test_monitor_reports_every_n_steps_without_process_group() -> None:
    monitor = StragglerMonitor(every_n=2, factor=1.5)
    assert monitor.record(1.0) is None
    report = monitor.record(3.0)
    assert report is not None
    assert report["ranks"] == [0]
    assert report["step_times_s"] == [2.0]
    assert report["median_s"] == 2.0
    assert report["stragglers"] == []
    assert report["window_steps"] == 2
    assert monitor.record(5.0) is None
    assert monitor.record(5.0)["step_times_s"] == [5.0]  # the window restarted


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("every_n", "factor"), [(0, 1.5), (1, 0.0), (2, math.nan)])
def test_monitor_rejects_bad_settings(every_n: int, factor: float) -> None:
    with pytest.raises(ValueError):
        StragglerMonitor(every_n=every_n, factor=factor)
