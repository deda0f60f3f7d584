"""Quarantine: set a committed checkpoint that fails verification aside, never loop on it.

Without it, a checkpoint whose shard was damaged after its commit made every relaunch
fall back to the previous one, re-run the steps and then fail to save the same step
again (committed checkpoints are never overwritten): a crash loop. Resume now sets
such a checkpoint aside, once every rank agrees it cannot be loaded, and the step can
be committed again. Nothing is deleted: the files stay for forensics until
``python -m ckpt gc --quarantined``.

Protocol (one process, the coordinator of the resume), crash-safe at every point:

1. write ``QUARANTINED`` (JSON: reason, file, time, the COMPLETE marker's bytes) into
   the checkpoint directory;
2. delete ``COMPLETE``: from here discovery reads the directory as *quarantined* (a
   directory without COMPLETE but with QUARANTINED), never as committed, and neither
   retention nor a new save's clean-up deletes it;
3. move the directory to ``checkpoint_0000008.quarantined-<UTC stamp>``, a name
   discovery does not take for a checkpoint (local: one rename; object stores: copy
   then delete). A save of the same step that finds step 2's state finishes the move
   first (:func:`finish_move`).
"""

from __future__ import annotations

import datetime
import json
import logging
import re
from dataclasses import dataclass

from ckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    UncommittedCheckpointError,
)
from ckpt.format.layout import COMPLETE_NAME, QUARANTINE_MARKER_NAME, checkpoint_dirname
from ckpt.storage import DIR, Storage

logger = logging.getLogger(__name__)

QUARANTINE_INFIX = ".quarantined-"
MAX_RECORD_BYTES = 1 << 20
"""A QUARANTINED record above this is not read (one holds a reason and a COMPLETE marker)."""
_QUARANTINED_DIR_RE = re.compile(r"^checkpoint_(\d{7,})\.quarantined-([0-9TZ]+)$")


@dataclass(frozen=True, slots=True, kw_only=True)
class QuarantinedCheckpoint:
    """A checkpoint set aside by :func:`quarantine` (or on its way there)."""

    step: int
    url: str
    dirname: str
    reason: str
    path: str = ""
    quarantined_at: str = ""
    moved: bool = True
    """False while it still sits under its checkpoint name (an interrupted move)."""


def quarantined_dirname(step: int, stamp: str) -> str:
    """``checkpoint_0000008.quarantined-20261124T033000123Z``."""
    return f"{checkpoint_dirname(step)}{QUARANTINE_INFIX}{stamp}"


def parse_quarantined_dirname(name: str) -> int | None:
    """The step of a quarantined directory name, or None if ``name`` is not one."""
    match = _QUARANTINED_DIR_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def _stamp() -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y%m%dT%H%M%S") + f"{now.microsecond // 1000:03d}Z"


def quarantine(storage: Storage, step: int, reason: str, path: str = "") -> QuarantinedCheckpoint:
    """Set the checkpoint of ``step`` aside (module docstring); returns where it is kept.

    Run by one process. Raises :class:`~ckpt.errors.CheckpointError` if a storage call
    fails; whatever point it stopped at is safe (never committed again, never deleted).
    """
    dirname = checkpoint_dirname(step)
    ckpt_dir = storage.child(dirname)
    try:
        marker = ckpt_dir.read_bytes(COMPLETE_NAME).decode("utf-8", "replace")
    except ObjectNotFoundError:
        raise UncommittedCheckpointError(
            f"{ckpt_dir.root_url} has no COMPLETE marker any more; nothing to quarantine",
            url=ckpt_dir.root_url,
        ) from None
    stamp = _stamp()
    record = {
        "step": step,
        "reason": reason,
        "path": path,
        "quarantined_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "stamp": stamp,
        "complete_marker": marker,
    }
    ckpt_dir.write_bytes(
        QUARANTINE_MARKER_NAME, json.dumps(record, indent=1).encode(), phase="quarantine"
    )
    ckpt_dir.remove(COMPLETE_NAME)
    ckpt_dir.sync_dir()
    target = quarantined_dirname(step, stamp)
    storage.move_tree(dirname, target)
    storage.sync_dir()
    return QuarantinedCheckpoint(
        step=step,
        url=storage.url(target),
        dirname=target,
        reason=reason,
        path=path,
        quarantined_at=str(record["quarantined_at"]),
    )


def read_record(storage: Storage, dirname: str) -> dict[str, object]:
    """The QUARANTINED record of a directory (``{}`` when unreadable: still quarantined)."""
    try:
        raw = storage.read_bytes(f"{dirname}/{QUARANTINE_MARKER_NAME}", max_bytes=MAX_RECORD_BYTES)
        data = json.loads(raw)
    except (CheckpointError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def record_matches(record: dict[str, object], dirname: str) -> bool:
    """Whether a QUARANTINED record was written for ``dirname``: its step, and for a moved
    directory its stamp, are the ones in the name. Only then is the directory provably one
    that quarantine set aside (``gc --quarantined`` deletes nothing else)."""
    name = dirname.rstrip("/").rsplit("/", 1)[-1]
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return False
    match = _QUARANTINED_DIR_RE.match(name)
    if match is not None:
        return int(match.group(1)) == step and record.get("stamp") == match.group(2)
    return name == checkpoint_dirname(step) if step >= 0 else False


def finish_move(storage: Storage, dirname: str) -> str:
    """Move a directory left quarantined-in-place (a move interrupted at step 3) aside.

    Called before a save reuses its step; returns the URL it was moved to.
    """
    record = read_record(storage, dirname)
    stamp = str(record.get("stamp") or _stamp())
    step = int(dirname.rsplit("_", 1)[-1])
    target = quarantined_dirname(step, stamp)
    storage.move_tree(dirname, target)
    logger.warning(
        "ckpt: finished setting aside quarantined %s: kept at %s",
        storage.url(dirname),
        storage.url(target),
    )
    return storage.url(target)


def list_quarantined(
    storage: Storage, entries: list[tuple[str, str]] | None = None
) -> list[QuarantinedCheckpoint]:
    """Quarantined checkpoints under ``storage`` (moved ones; newest step first).

    Directories still under their checkpoint name are reported by discovery (status
    ``quarantined``), not here.
    """
    if entries is None:
        entries = storage.list_dir()
    found = []
    for name, kind in entries:
        step = parse_quarantined_dirname(name)
        if step is None or kind != DIR:  # a link or a file is foreign (discovery lists it)
            continue
        record = read_record(storage, name)
        found.append(
            QuarantinedCheckpoint(
                step=step,
                url=storage.url(name),
                dirname=name,
                reason=str(record.get("reason", "(no QUARANTINED record)")),
                path=str(record.get("path", "")),
                quarantined_at=str(record.get("quarantined_at", "")),
            )
        )
    return sorted(found, key=lambda q: (q.step, q.dirname), reverse=True)


def should_quarantine(exc: CheckpointError) -> bool:
    """Whether a load failure means the checkpoint itself is bad (not storage trouble).

    Only verification failures (a missing, truncated or damaged file, unsafe metadata)
    quarantine; a storage outage or a checkpoint removed while listing does not.
    """
    return isinstance(exc, CorruptCheckpointError) and not isinstance(
        exc, UncommittedCheckpointError
    )
