"""Run records: ``metrics.jsonl`` (one object per optimizer step) and the event files.

The layout ``python -m trainer report`` reads; the trainer and user scripts write it
with :class:`RunRecorder` (standard library only). ``RunGuard(on_event=recorder.event)``
sends it the guard's events.

Global rank 0 writes ``metrics.jsonl`` and every event to ``events.jsonl``. Another
rank writes only the events its caller marks ``every_rank=True`` (a fault injected on
that rank, its own failure, a watchdog or detector verdict), each rank to its own
``events.rank{R}.jsonl`` in the same run directory, so ranks never share a file.
Every event line carries the ``rank`` that wrote it. Callers need no
``if rank == 0``. Lines are flushed as they are written so a killed run keeps its
record. Writes are serialized by a lock: an asynchronous checkpoint reports its
commit from the save thread while the training thread writes metrics.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, TextIO

from runcore import events as ev
from runcore.redact import redact_fields

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
"""Events of global rank 0 (every event it records)."""
RANK_EVENTS_FILE = "events.rank{rank}.jsonl"
"""Events of another rank (only ``every_rank=True`` ones): ``RANK_EVENTS_FILE.format(rank=R)``."""
RANK_EVENTS_GLOB = "events.rank*.jsonl"
"""Glob matching every :data:`RANK_EVENTS_FILE` in a run directory."""


def rank_events_file(rank: int) -> str:
    """File name of the events written by ``rank``: ``events.jsonl`` for rank 0."""
    return EVENTS_FILE if rank == 0 else RANK_EVENTS_FILE.format(rank=rank)


class RunRecorder:
    """Appends JSON lines to the run directory.

    ``rank`` is the global rank: 0 writes metrics and every event, a positive rank
    only ``every_rank`` events to its own file, a negative rank (or an empty
    ``run_dir``) nothing.
    """

    def __init__(self, run_dir: str, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"RunRecorder rank must be an int (the global rank), got {rank!r}")
        self.run_dir = run_dir
        self.rank = int(rank)
        self.enabled = self.rank >= 0 and bool(run_dir)
        self._metrics: TextIO | None = None
        self._events: TextIO | None = None
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        if self.enabled:
            os.makedirs(run_dir, exist_ok=True)
            if self.rank == 0:
                self._metrics = open(os.path.join(run_dir, METRICS_FILE), "a", encoding="utf-8")  # noqa: SIM115
            path = os.path.join(run_dir, rank_events_file(self.rank))
            self._events = open(path, "a", encoding="utf-8")  # noqa: SIM115

    @property
    def is_main(self) -> bool:
        """True on the recorder that writes metrics and every event (global rank 0)."""
        return self.enabled and self.rank == 0

    def metrics(self, record: dict[str, Any]) -> None:
        """Write one optimizer step's metrics (``time`` is added when missing; rank 0 only)."""
        self._write(self._metrics, {"time": time.time(), **record})

    def event(self, name: str, step: int, *, every_rank: bool = False, **fields: Any) -> None:
        """Write one event (checkpoint saved/loaded, resume, fallback, fault ...).

        Rank 0 writes every event; another rank only those with ``every_rank=True``.
        The line gets ``"rank"`` unless ``fields`` already has one. A known event
        (``runcore.events.SCHEMA``) missing one of its fields is written anyway and said
        at WARNING once per name: readers of the run log rely on those fields.
        """
        if self.rank != 0 and not every_rank:
            return
        record = {"event": name, "step": step, "time": time.time(), "rank": self.rank, **fields}
        if name in ev.SCHEMA and name not in self._warned:
            missing = ev.missing_fields(record)
            if missing:
                self._warned.add(name)
                logger.warning(
                    "run log: event %r lacks field(s) %s of its schema (runcore/events.py)",
                    name,
                    ", ".join(missing),
                )
        self._write(self._events, record)

    def _write(self, fh: TextIO | None, record: dict[str, Any]) -> None:
        if fh is None:
            return
        line = json.dumps(redact_fields(record), sort_keys=True) + "\n"
        with self._lock:
            if fh.closed:
                return
            fh.write(line)
            fh.flush()

    def close(self) -> None:
        with self._lock:
            for fh in (self._metrics, self._events):
                if fh is not None:
                    fh.close()
            self._metrics = self._events = None

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
