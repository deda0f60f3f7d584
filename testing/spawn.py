"""The gloo rank spawner of the test suite: :mod:`bench.spawn` (shipped with ``bench``).

Run a function on N local processes joined in a gloo process group, each a ``spawn``ed
process, every run bounded by a deadline (its own pids killed on expiry).
"""

from __future__ import annotations

from bench.spawn import RankFailedError, RankOutcome, run_ok, run_ranks

__all__ = ["RankFailedError", "RankOutcome", "run_ok", "run_ranks"]
