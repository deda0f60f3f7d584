"""Peak resident memory of this process during an operation, by sampling ``/proc/self/statm``."""

from __future__ import annotations

import os
import threading
from types import TracebackType

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRss:
    """Context manager: ``growth`` is the peak RSS inside the block minus the RSS at entry.

    A thread samples every ``interval_s``; a spike shorter than that can be missed,
    so the figure is a lower bound on the true peak.
    """

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.start = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> PeakRss:
        self.start = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._sample, name="bench-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.start
