"""Run outputs: ``metrics.jsonl`` (one object per optimizer step) and ``events.jsonl``.

Only global rank 0 writes; on other ranks the writer is a no-op, so callers need no
``if rank == 0``. Lines are flushed as they are written so a killed run keeps its record.
Writes are serialized by a lock: an asynchronous checkpoint reports its commit from
the save thread while the training thread writes metrics.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, TextIO

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"


class RunRecorder:
    """Appends JSON lines to the run directory (rank 0 only; other ranks do nothing)."""

    def __init__(self, run_dir: str, enabled: bool) -> None:
        self.run_dir = run_dir
        self.enabled = enabled and bool(run_dir)
        self._metrics: TextIO | None = None
        self._events: TextIO | None = None
        self._lock = threading.Lock()
        if self.enabled:
            os.makedirs(run_dir, exist_ok=True)
            self._metrics = open(os.path.join(run_dir, METRICS_FILE), "a", encoding="utf-8")  # noqa: SIM115
            self._events = open(os.path.join(run_dir, EVENTS_FILE), "a", encoding="utf-8")  # noqa: SIM115

    def metrics(self, record: dict[str, Any]) -> None:
        """Write one optimizer step's metrics (``time`` is added when missing)."""
        self._write(self._metrics, {"time": time.time(), **record})

    def event(self, name: str, step: int, **fields: Any) -> None:
        """Write one event (checkpoint saved/loaded, resume, fallback, fault ...)."""
        self._write(self._events, {"event": name, "step": step, "time": time.time(), **fields})

    def _write(self, fh: TextIO | None, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True) + "\n"
        with self._lock:
            if fh is None or fh.closed:
                return
            fh.write(line)
            fh.flush()

    def close(self) -> None:
        with self._lock:
            for fh in (self._metrics, self._events):
                if fh is not None:
                    fh.close()
            self._metrics = self._events = None
