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
id>-<launch>.json`` (every rank of every node meets the same deterministic error, so a
node's own note suffices). A job is its run id (``TORCHELASTIC_RUN_ID``) and the launch
of this node's torchrun agent (its log directory, from ``TORCHELASTIC_ERROR_FILE``:
two jobs launched with torchrun's default ``--rdzv_id`` of ``none`` on one node share
the run id, never the agent), with a growing restart count: a note whose restart count
is not below this attempt's is from an earlier launch, and is dropped. The ranks of a
node write the same note at the end of an attempt; one that finds the note already
written for this attempt by a peer keeps its verdict (:func:`merge_note`). An error
that ends the job at once (``runcore.errors.JobEndingError``: an unusable root, another
job's root, a configuration that does not parse) is noted as repeated at its first
occurrence. A process outside torchrun has no restarts and writes nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
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


def merge_note(previous: ErrorNote | None, current: ErrorNote, *, ends_job: bool) -> ErrorNote:
    """The note to write for ``current``: repeated when it repeats ``previous`` or ends
    the job; a note a peer of this node already wrote for the same attempt, error and
    point keeps its verdict (a peer that read the earlier attempt's note first may have
    found the repeat). Pure."""
    repeated = ends_job or same_failure(previous, current)
    if (
        previous is not None
        and previous.restart_count == current.restart_count
        and previous.error == current.error
        and previous.point == current.point
    ):
        repeated = repeated or previous.repeated
    return dataclasses.replace(current, repeated=repeated)


ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
"""Set by torchrun for each worker: ``<agent log dir>/<run>_<x>/attempt_N/<rank>/error.json``."""
_LAUNCH_RE = re.compile(r"^(.+)/attempt_\d+/\d+/error\.json$")


def launch_key(env: Mapping[str, str] | None = None) -> str:
    """This node's torchrun launch (its agent's log directory, the same in every attempt),
    hashed; empty when unknown."""
    error_file = (os.environ if env is None else env).get(ERROR_FILE, "")
    match = _LAUNCH_RE.match(error_file)
    if match is None:
        return ""
    return hashlib.sha256(match.group(1).encode()).hexdigest()[:16]


class RepeatNotes:
    """The node-local note of one job (one file; written atomically, read leniently)."""

    def __init__(self, run_id: str, directory: str | None = None, launch: str = "") -> None:
        base = directory if directory is not None else tempfile.gettempdir()
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:128] or "_"
        name = f"{safe}-{launch}" if launch else safe
        self.path = os.path.join(base, NOTES_DIR, f"{name}.json")

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


def note_for(
    identity: RunIdentity, directory: str | None = None, env: Mapping[str, str] | None = None
) -> RepeatNotes | None:
    """The job's notes, or None outside torchrun (no restarts to save)."""
    if not identity.is_torchrun:
        return None
    return RepeatNotes(identity.run_id, directory, launch_key(env))


def note_job_ending(
    identity: RunIdentity,
    error: str,
    message: str,
    directory: str | None = None,
    env: Mapping[str, str] | None = None,
) -> None:
    """Note an error that ends the job before any guard exists (the trainer's config),
    so the remaining attempts end at start-up; nothing outside torchrun."""
    notes = note_for(identity, directory, env)
    if notes is not None:
        notes.write(
            ErrorNote(
                error=error,
                point="start-up",
                message=" ".join(message.split())[:MAX_MESSAGE_CHARS],
                restart_count=identity.restart_count,
                repeated=True,
            )
        )


def stop_if_repeated(
    identity: RunIdentity, directory: str | None = None, env: Mapping[str, str] | None = None
) -> None:
    """At an attempt's start: raise :class:`RepeatedErrorStop` when an earlier attempt of
    this job noted a repeated deterministic error; drop a note of an earlier launch."""
    notes = note_for(identity, directory, env)
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
        f"restart {note.restart_count} ended with {note.error} at {note.point}, which a "
        f"restart cannot fix ({note.message}). Fix the cause and launch the job again"
    )
    logger.error("%s", message)
    raise RepeatedErrorStop(message)
