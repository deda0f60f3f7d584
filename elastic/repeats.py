"""A deterministic error across the attempts of one job: noted, and ended when it repeats.

torchrun restarts a failed worker group up to ``--max_restarts`` times. For an error
that the same code reproduces (``runcore.errors.DeterministicError``: a model whose
shapes differ from its checkpoint, a loop that never advances its sampler) each restart
pays a full start-up (imports, model, checkpoint load) to fail again with the same
traceback. ``elastic.RunGuard`` notes such an error when it ends an attempt; when the
next attempt ends with the same error at the same point (:func:`same_failure`), the
note says so, and every later attempt of the job stops at its start
(:func:`stop_if_repeated`, called by ``elastic.init_distributed`` and ``RunGuard``,
before any process group or checkpoint load), so the remaining restarts end in
seconds.

The note is one small JSON file per job on each node, ``<tmp>/elastic-repeats/<run
id>.json`` (every rank of every node meets the same deterministic error, so a node's
own note suffices). A job is its run id (``TORCHELASTIC_RUN_ID``) and a growing restart
count: a note whose restart count is not below this attempt's is from an earlier launch
that reused the run id (torchrun's default ``--rdzv_id`` is ``none``), and is dropped.
A process outside torchrun has no restarts and writes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from dataclasses import asdict, dataclass

from elastic.errors import RepeatedErrorStop
from elastic.identity import RunIdentity

logger = logging.getLogger(__name__)

NOTES_DIR = "elastic-repeats"
"""Directory of the notes, under the temporary directory (``tempfile.gettempdir()``)."""
MAX_NOTE_BYTES = 64 << 10
"""A note larger than this is not ours (messages are cut to :data:`MAX_MESSAGE_CHARS`)."""
MAX_MESSAGE_CHARS = 2000


@dataclass(frozen=True, slots=True)
class ErrorNote:
    """A deterministic error that ended one attempt of a job."""

    error: str
    """The exception's type name."""
    point: str
    """Where: ``"step 12"``, or ``"start-up"`` before the first step (a resume)."""
    message: str
    restart_count: int
    """The attempt (job-wide restart count) it ended."""
    repeated: bool = False
    """The previous attempt ended with the same error at the same point."""


def same_failure(previous: ErrorNote | None, current: ErrorNote) -> bool:
    """Whether ``current`` repeats ``previous``: the same error type at the same point,
    one attempt or more later. Pure."""
    return (
        previous is not None
        and previous.error == current.error
        and previous.point == current.point
        and previous.restart_count < current.restart_count
    )


class RepeatNotes:
    """The node-local note of one job (one file; written atomically, read leniently)."""

    def __init__(self, run_id: str, directory: str | None = None) -> None:
        base = directory if directory is not None else tempfile.gettempdir()
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:128] or "_"
        self.path = os.path.join(base, NOTES_DIR, f"{safe}.json")

    def read(self) -> ErrorNote | None:
        """The note, or None when there is none or it does not parse (never an error)."""
        try:
            if os.path.getsize(self.path) > MAX_NOTE_BYTES:
                return None
            with open(self.path, encoding="utf-8") as handle:
                data = json.load(handle)
            return ErrorNote(
                error=str(data["error"]),
                point=str(data["point"]),
                message=str(data["message"])[:MAX_MESSAGE_CHARS],
                restart_count=int(data["restart_count"]),
                repeated=bool(data.get("repeated", False)),
            )
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def write(self, note: ErrorNote) -> None:
        """Replace the note (atomically: ranks of one node may write at once)."""
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump(asdict(note), handle)
            os.replace(tmp, self.path)
        except OSError as exc:  # a diagnostic: never hide the error being reported
            logger.warning(
                "could not note the error for the next attempt in %s: %s", self.path, exc
            )

    def clear(self) -> None:
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("could not remove %s: %s", self.path, exc)


def note_for(identity: RunIdentity, directory: str | None = None) -> RepeatNotes | None:
    """The job's notes, or None outside torchrun (no restarts to save)."""
    if not identity.is_torchrun:
        return None
    return RepeatNotes(identity.run_id, directory)


def stop_if_repeated(identity: RunIdentity, directory: str | None = None) -> None:
    """At an attempt's start: raise :class:`RepeatedErrorStop` when an earlier attempt of
    this job noted a repeated deterministic error; drop a note of an earlier launch."""
    notes = note_for(identity, directory)
    if notes is None:
        return
    note = notes.read()
    if note is None:
        return
    if identity.restart_count <= note.restart_count:
        notes.clear()  # an earlier launch with the same run id: not this job's
        return
    if not note.repeated:
        return
    message = (
        f"rank {identity.rank}: restart {identity.restart_count} of this job ends at start-up: "
        f"restart {note.restart_count} ended with {note.error} at {note.point} as the attempt "
        f"before it did, and a restart cannot fix it ({note.message}). Fix the cause and "
        "launch the job again"
    )
    logger.error("%s", message)
    raise RepeatedErrorStop(message)
