"""What this library may delete under a root: only what it can prove it wrote.

A directory named like a checkpoint is not a proof: a user may keep notes in one, link
one from another root, or rename a committed checkpoint by hand. Retention, ``ckpt gc``
and a save's clean-up of a dead attempt therefore delete a directory only when

- every entry in it is a regular file (no symbolic link, nothing else) whose name is one
  this library writes into a checkpoint directory (:func:`is_library_file`), and, for a
  committed checkpoint, one its manifest lists (or the marker files around it); and
- its records say it is the library's to delete: a committed checkpoint (COMPLETE vouches
  for its manifest), a quarantine record naming the directory's step and stamp, or, for
  an uncommitted directory, an ``ATTEMPT`` record or manifest naming the run that asks
  (``run_id``; ``None`` is an operator running ``ckpt gc``, who may clear any run's).

Anything else is left in place, and the caller says why at WARNING (:func:`say_left_alone`).
Everything here only reads; the callers delete.

Directly under a root, the library also keeps records that are not checkpoints: the owner
lease (:mod:`ckpt.root.lease`; names ``OWNER``, ``OWNER.<generation>``, ``.OWNER.tmp-*``:
:func:`ckpt.format.layout.is_lease_name`) and a root check's short-lived write probe
(``.probe-*``). Retention and ``gc`` delete checkpoint directories only, so they never
touch them, and discovery never takes them for checkpoints (they are not named
``checkpoint_N``); the lease outlives every checkpoint of its root.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ckpt.errors import CheckpointError
from ckpt.format.layout import (
    ATTEMPT_NAME,
    COMPLETE_NAME,
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    QUARANTINE_MARKER_NAME,
    is_shard_filename,
)
from ckpt.format.manifest import MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, Manifest
from ckpt.storage import FILE, Storage
from ckpt.storage.gcs_parts import is_part_key

logger = logging.getLogger(__name__)

MARKERS = frozenset({MANIFEST_NAME, COMPLETE_NAME, ATTEMPT_NAME, QUARANTINE_MARKER_NAME})
"""Files around a checkpoint's data that its manifest does not list."""


def is_library_file(path: str) -> bool:
    """Whether ``path`` (relative to a checkpoint directory) is a name this library writes."""
    return (
        path in MARKERS
        or path == DCP_METADATA_NAME
        or is_shard_filename(path)
        or (is_part_key(path) and "/" in path and ".." not in path.split("/"))
    )


def strangers(listing: dict[str, dict[str, Any]], manifest: Manifest | None = None) -> list[str]:
    """Entries of a directory listing (``Storage.list_files``) that are not provably ours.

    With ``manifest`` (a committed checkpoint) a data file must also be one it lists.
    Each is described for a message: ``"notes.txt"``, ``"rank_00000.distcp (a link)"``.
    """
    listed = {e.path for e in manifest.files} if manifest is not None else None
    out = []
    for path, meta in sorted(listing.items()):
        kind = meta.get("type", FILE)
        if kind != FILE:
            out.append(f"{path} (a {kind})")
        elif not is_library_file(path):
            out.append(path)
        elif (
            listed is not None
            and path not in MARKERS
            and not is_part_key(path)
            and path not in listed
        ):
            out.append(f"{path} (not in its manifest)")
    return out


def read_attempt(storage: Storage, dirname: str) -> dict[str, Any] | None:
    """The ``ATTEMPT`` record of a directory, or None when missing or not a record."""
    try:
        raw = storage.read_bytes(f"{dirname}/{ATTEMPT_NAME}", max_bytes=MAX_MARKER_BYTES)
        data = json.loads(raw.decode("utf-8"))
    except (CheckpointError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("run_id"), str):
        return None
    return data


def attempt_record(
    run_id: str, restart_count: int, save_id: str, host: str, *, deleting: bool = False
) -> bytes:
    """The bytes of an ``ATTEMPT`` record. ``deleting``: written by retention into a
    committed checkpoint it is about to delete, so that a prune killed half-way leaves a
    directory any later prune may finish (it was provably ours and condemned)."""
    record = {"run_id": run_id, "restart_count": restart_count, "save_id": save_id, "host": host}
    if deleting:
        record["deleting"] = True
    return json.dumps(record).encode()


def being_deleted(storage: Storage, dirname: str) -> bool:
    """Whether an uncommitted directory's ATTEMPT record says retention was deleting it."""
    record = read_attempt(storage, dirname)
    return record is not None and record.get("deleting") is True


def uncommitted_owner(storage: Storage, dirname: str) -> str | None:
    """The run id an uncommitted directory's records name (ATTEMPT, else its manifest)."""
    record = read_attempt(storage, dirname)
    if record is not None:
        return str(record["run_id"])
    try:
        raw = storage.read_bytes(f"{dirname}/{MANIFEST_NAME}", max_bytes=MAX_MANIFEST_BYTES)
        return Manifest.from_bytes(raw).attempt.run_id
    except CheckpointError:
        return None


def say_left_alone(said: set[str] | None, url: str, message: str) -> None:
    """Say at WARNING that something was left in place; once per URL in ``said``.

    Retention runs after every commit: a directory it may not delete would otherwise be
    reported at every save of a month-long run, so its saver keeps ``said``. ``None``
    (the ``gc`` command): say it every time.
    """
    if said is not None:
        if url in said:
            return
        said.add(url)
    logger.warning("ckpt: %s", message)
