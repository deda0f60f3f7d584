"""Straggler detection: which ranks are much slower than the median.

In synchronous data-parallel training the slowest rank sets the pace of all. Each
rank times its own steps; every N steps the ranks exchange their mean step time (one
all_gather of one float) and the ranks slower than `factor` times the median are
reported, for the trainer to write as an event.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from elastic.collectives import all_gather_floats, distributed_ready

logger = logging.getLogger(__name__)

DEFAULT_STRAGGLER_FACTOR = 1.5


def find_stragglers(step_times: Sequence[float], factor: float) -> list[int]:
    """Return the indices whose time is greater than `factor` times the median.

    Pure. Non-finite times (a rank that reported nothing) count as stragglers and are
    left out of the median. Returns [] for an empty sequence.
    """
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"straggler factor must be a finite number > 0, got {factor}")
    finite = [t for t in step_times if math.isfinite(t)]
    if not finite:
        return [index for index, _ in enumerate(step_times)]
    threshold = factor * statistics.median(finite)
    return [index for index, t in enumerate(step_times) if not math.isfinite(t) or t > threshold]


class StragglerMonitor:
    """Collects this rank's step times and compares them across ranks every N steps.

    Every rank of the group creates one with the same `every_n` and calls `record`
    after every step, so the all_gather inside happens at the same steps on all ranks
    (it is a collective on those calls). Without an initialized process group the
    report covers this process only.
    """

    def __init__(
        self,
        every_n: int,
        factor: float = DEFAULT_STRAGGLER_FACTOR,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if every_n < 1:
            raise ValueError(f"straggler every_n must be >= 1, got {every_n}")
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"straggler factor must be a finite number > 0, got {factor}")
        self.every_n = every_n
        self.factor = factor
        self.process_group = process_group
        self._window: list[float] = []

    def record(self, step_s: float) -> dict[str, Any] | None:
        """Add one step's duration; every `every_n` calls, gather and return a report.

        The report: `window_steps`, `ranks` (global rank of each entry),
        `step_times_s` (mean step time per rank over the window), `median_s`,
        `factor` and `stragglers` (global ranks). Returns None on the other calls.
        """
        self._window.append(float(step_s))
        if len(self._window) < self.every_n:
            return None
        mean_s = sum(self._window) / len(self._window)
        self._window.clear()
        times = all_gather_floats(mean_s, self.process_group)
        if distributed_ready():
            group = dist.group.WORLD if self.process_group is None else self.process_group
            ranks = list(dist.get_process_group_ranks(group))
        else:
            ranks = [0]
        finite = [t for t in times if math.isfinite(t)]
        stragglers = [ranks[index] for index in find_stragglers(times, self.factor)]
        report: dict[str, Any] = {
            "window_steps": self.every_n,
            "ranks": ranks,
            "step_times_s": times,
            "median_s": statistics.median(finite) if finite else math.nan,
            "factor": self.factor,
            "stragglers": stragglers,
        }
        if stragglers:
            logger.warning(
                "straggler ranks %s: mean step times %s s, median %.4f s",
                stragglers,
                [round(t, 4) for t in times],
                report["median_s"],
            )
        return report
