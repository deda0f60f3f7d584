"""Run a benchmark function on N spawned processes joined in a gloo process group.

A thin wrapper over :mod:`testing.spawn` (bounded, kills only its own pids) with the
longer collective timeout that large saves need.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from testing.spawn import RankFailedError, run_ok

__all__ = ["RankFailedError", "run_on_ranks"]


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; results in rank order."""
    return run_ok(fn, world_size, *args, timeout_s=timeout_s, pg_timeout_s=300.0)
