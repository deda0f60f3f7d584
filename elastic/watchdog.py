"""Hang detection: a thread that ends the process when training stops making progress.

A rank stuck in a collective whose peer died, a deadlocked data loader or a wedged
storage call would otherwise hold the whole job until a human notices. The watchdog
turns "no step finished for `timeout_s`" into a stack dump of every thread (to see
where it hung) and an exit with a known code, which torchrun treats as a worker
failure and answers by restarting the group from the last committed checkpoint.

Collective timeouts are the other half: the timeout given to `init_process_group`
should be short (`process_group_timeout()`, 120 s by default) so that a dead peer
surfaces as an error in the surviving ranks instead of a silent wait; gloo honours it
for every collective, NCCL when async error handling is on (the default in recent
torch). Keep the watchdog's timeout above it, so that an ordinary collective timeout is
reported as an error first and the watchdog catches what no timeout covers.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from elastic.identity import RunIdentity
from elastic.process import call_bounded, leave_from_monitor

logger = logging.getLogger(__name__)

DEFAULT_STALL_EXIT_CODE = 124
"""Exit code after a stall (the code coreutils `timeout` uses)."""
DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
ON_STALL_LIMIT_S = 10.0
"""The most the `on_stall` callback may take before the process exits anyway."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StallInfo:
    """What the watchdog saw when it gave up on the process."""

    step: int | None
    """Last step reported by `beat` (None if none yet)."""
    stalled_s: float
    """Seconds since the last beat (or since start/resume)."""
    dump_path: str | None
    """File holding every thread's stack, None if it could not be written."""
    rank: int


def process_group_timeout(seconds: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> datetime.timedelta:
    """Return the timeout to pass to `init_process_group` (short, so dead peers surface).

    Every rank passes the same value. Pure.
    """
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"collective timeout must be a finite number > 0 seconds, got {seconds}")
    return datetime.timedelta(seconds=seconds)


class Watchdog:
    """Daemon thread that dumps all stacks and exits when `beat` stops being called.

    Every rank creates one after setup and calls `beat(step)` after every optimizer
    step; phases known to be slow are wrapped in `allow(seconds)` or `pause()`/
    `resume()`. On a stall it writes `stacks_rank{R}_pid{P}_{unixtime}.txt` in
    `dump_dir`, logs an error naming the step and the file, calls `on_stall` (bounded
    to ON_STALL_LIMIT_S), then calls `os._exit(exit_code)`.
    """

    def __init__(
        self,
        timeout_s: float,
        dump_dir: str,
        exit_code: int = DEFAULT_STALL_EXIT_CODE,
        on_stall: Callable[[StallInfo], None] | None = None,
        *,
        rank: int | None = None,
        poll_s: float | None = None,
    ) -> None:
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"watchdog timeout_s must be a finite number > 0, got {timeout_s}")
        if not 0 <= exit_code <= 255:
            raise ValueError(f"watchdog exit_code must be in [0, 255], got {exit_code}")
        self.timeout_s = float(timeout_s)
        self.dump_dir = dump_dir
        self.exit_code = exit_code
        self.on_stall = on_stall
        self.rank = RunIdentity.from_env().rank if rank is None else rank
        self._poll_s = min(1.0, self.timeout_s / 4) if poll_s is None else poll_s
        self._lock = threading.Lock()
        self._last_beat = time.monotonic()
        self._step: int | None = None
        self._paused = False
        self._allow_until: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"elastic-watchdog-rank{self.rank}", daemon=True
        )
        self._thread.start()

    def beat(self, step: int) -> None:
        """Record that `step` finished now. Cheap; called by every rank after each step."""
        # Two attribute stores; the monitor thread tolerates reading them mid-update.
        self._last_beat = time.monotonic()
        self._step = step

    def set_timeout(self, timeout_s: float) -> None:
        """Change the bound (e.g. once step times are known); counts from the last beat."""
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"watchdog timeout_s must be a finite number > 0, got {timeout_s}")
        with self._lock:
            self.timeout_s = float(timeout_s)

    def pause(self) -> None:
        """Stop stall detection until `resume` (for phases with no bound, e.g. user input)."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        """Restart stall detection, counting the timeout from now."""
        with self._lock:
            self._paused = False
            self._last_beat = time.monotonic()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Context manager form of `pause`/`resume`."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    @contextlib.contextmanager
    def allow(self, seconds: float) -> Iterator[None]:
        """Allow at least `seconds` without a beat inside the block (first step, loads).

        The deadline becomes the later of the usual one and now + seconds; leaving the
        block counts the usual timeout from then. Nested blocks keep the latest deadline.
        """
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"watchdog allowance must be a finite number >= 0, got {seconds}")
        with self._lock:
            previous = self._allow_until
            until = time.monotonic() + seconds
            self._allow_until = until if previous is None else max(previous, until)
        try:
            yield
        finally:
            with self._lock:
                self._allow_until = previous
                self._last_beat = time.monotonic()

    @property
    def running(self) -> bool:
        """True while the monitor thread is watching (until `close` or a stall)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the monitor thread; safe to call more than once."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 2 * self._poll_s))

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _deadline(self) -> float | None:
        with self._lock:
            if self._paused:
                return None
            deadline = self._last_beat + self.timeout_s
            if self._allow_until is not None:
                deadline = max(deadline, self._allow_until)
            return deadline

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            deadline = self._deadline()
            if deadline is not None and time.monotonic() > deadline:
                self._stall()
                return

    def _dump_stacks(self) -> str | None:
        name = f"stacks_rank{self.rank}_pid{os.getpid()}_{int(time.time())}.txt"
        path = os.path.join(self.dump_dir, name)
        try:
            os.makedirs(self.dump_dir, exist_ok=True)
            with open(path, "w", encoding="utf-8") as out:
                out.write(
                    f"watchdog: rank {self.rank} pid {os.getpid()} made no progress for "
                    f"{time.monotonic() - self._last_beat:.1f}s after step {self._step}\n"
                )
                out.flush()
                faulthandler.dump_traceback(file=out, all_threads=True)
        except OSError as exc:
            logger.error("rank %d: could not write stack dump %s: %s", self.rank, path, exc)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            return None
        return path

    def _stall(self) -> None:
        stalled_s = time.monotonic() - self._last_beat
        path = self._dump_stacks()
        info = StallInfo(step=self._step, stalled_s=stalled_s, dump_path=path, rank=self.rank)
        logger.error(
            "rank %d: no progress for %.1fs after step %s (timeout %.1fs); stacks in %s; "
            "exiting with code %d so torchrun restarts the group",
            self.rank,
            stalled_s,
            self._step,
            self.timeout_s,
            path,
            self.exit_code,
        )
        if self.on_stall is not None:
            call_bounded(self.on_stall, info, name="elastic-watchdog-on-stall",
                         limit_s=ON_STALL_LIMIT_S,
                         what=f"rank {self.rank}: watchdog on_stall callback")  # fmt: skip
        leave_from_monitor(self.exit_code)
