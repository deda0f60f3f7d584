"""Run outputs of the trainer: ``elastic.events`` (the layout user scripts write too)."""

from __future__ import annotations

from elastic.events import (
    EVENTS_FILE,
    METRICS_FILE,
    RANK_EVENTS_FILE,
    RANK_EVENTS_GLOB,
    RunRecorder,
    rank_events_file,
)

__all__ = [
    "EVENTS_FILE",
    "METRICS_FILE",
    "RANK_EVENTS_FILE",
    "RANK_EVENTS_GLOB",
    "RunRecorder",
    "rank_events_file",
]
