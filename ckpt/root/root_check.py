"""Is a checkpoint root usable? Not inside a checkpoint, and writable (local steps).

:meth:`ckpt.CheckpointManager.check_root` runs these before a job trains, so a
mistake costs seconds, not a run:

- :func:`refuse_checkpoint_as_root`: users paste checkpoint URLs
  (``runs/x/ckpt/checkpoint_0000008``) where a root is expected; saving there
  would create checkpoints *inside* a committed one and resume nothing. Read only:
  it runs before anything is created.
- :func:`probe_writable`: a small object written, read back and deleted through the
  same storage path as a save (an existing root the job cannot write, a read-only
  mount, a bucket without write permission). Without it such a run trained to the
  end, every save failing, and exited 0 with no checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from typing import Any

from ckpt import dist as _dist
from ckpt.errors import CheckpointDirError, StorageError
from ckpt.format.layout import (
    COMPLETE_NAME,
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    PROBE_PREFIX,
    parse_checkpoint_dirname,
)
from ckpt.storage import Storage, StorageOptions
from ckpt.storage.faults import FaultRegistry

CHECKPOINT_FILES = (COMPLETE_NAME, MANIFEST_NAME, DCP_METADATA_NAME)
"""Files only a checkpoint directory holds: a root holding one is a checkpoint."""

ANCESTOR_LEVELS = 3
"""How many parents of the root are checked for being a checkpoint directory."""


def refuse_checkpoint_as_root(storage: Storage, entries: list[tuple[str, bool]]) -> None:
    """Raise :class:`CheckpointDirError` when ``storage``'s root is, or is inside, a checkpoint.

    ``entries``: the root's listing (``Storage.list_dir``). The root is a checkpoint
    when it holds COMPLETE, manifest.json or .metadata, or when its name is a
    checkpoint directory name and its parent holds checkpoint directories; it is
    inside one when one of its first :data:`ANCESTOR_LEVELS` parents is named like a
    checkpoint directory and holds such files. The message names the root to use.
    """
    storage = _unfaulted(storage)
    root = storage.root_url
    parents = _parents(storage)
    names = {name for name, _ in entries}
    found = sorted(names.intersection(CHECKPOINT_FILES))
    if found:
        _refuse(root, root, parents[0] if parents else "/", f"it holds {', '.join(found)}")
    named_like_one = parse_checkpoint_dirname(root) is not None and parents
    if named_like_one and any(
        parse_checkpoint_dirname(name) is not None for name in _names(parents[0], storage)
    ):
        _refuse(
            root,
            root,
            parents[0],
            f"its name is a checkpoint directory name and {parents[0]} holds checkpoints",
        )
    for level, url in enumerate(parents[:ANCESTOR_LEVELS]):
        if parse_checkpoint_dirname(url) is None:
            continue
        if _names(url, storage).intersection(CHECKPOINT_FILES):
            parent = parents[level + 1] if level + 1 < len(parents) else "/"
            _refuse(root, url, parent, "it is inside that checkpoint directory")


def _names(url: str, storage: Storage) -> set[str]:
    """Entry names of ``url``; none when it cannot be listed (then nothing is proven)."""
    try:
        return {name for name, _ in Storage(url, storage.options).list_dir()}
    except StorageError:
        return set()


def _refuse(root: str, checkpoint: str, parent: str, why: str) -> None:
    raise CheckpointDirError(
        f"checkpoint root {root!r} is not a root but a checkpoint directory ({checkpoint}: "
        f"{why}); nothing was written there. Pass the directory that holds the checkpoints: "
        f"--ckpt-dir {parent} (CheckpointManager({parent!r}, ...))"
    )


def _parents(storage: Storage) -> list[str]:
    """URLs of the root's parents, nearest first (not above a bucket or the filesystem root)."""
    url = storage.root_url
    scheme, sep, path = url.partition("://")
    if not sep:
        scheme, path = "", os.path.abspath(url)
    prefix = f"{scheme}://" if scheme else ""
    floor = 0 if not scheme or scheme in ("file", "local", "memory") else 1  # keep the bucket
    parts = [p for p in path.split("/") if p]
    lead = "/" if path.startswith("/") else ""
    out = []
    for keep in range(len(parts) - 1, floor, -1):
        out.append(prefix + lead + "/".join(parts[:keep]))
    if floor == 0 and parts and lead:
        out.append(prefix + "/")
    return out


def _unfaulted(storage: Storage) -> Storage:
    """``storage`` without injected faults: those are planned for saves and loads."""
    clean = dataclasses.replace(storage.options, faults=FaultRegistry(read_env=False))
    return Storage(storage.root_url, clean)


def probe_writable(storage: Storage) -> None:
    """Write, read back and delete a small probe object under the root (local step).

    The probe bypasses injected storage faults and has a unique name per host and
    process, so ranks may probe at once.
    Raises what the storage raised, or :class:`CheckpointDirError` if the bytes read
    back differ.
    """
    probe = _unfaulted(storage)
    name = f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    payload = f"ckpt write probe {name}\n".encode()
    probe.write_bytes(name, payload, phase="probe")
    try:
        back = probe.read_bytes(name, phase="probe")
    finally:
        probe.remove(name)
    if back != payload:
        raise CheckpointDirError(
            f"checkpoint root {storage.root_url!r}: a probe object read back different bytes "
            f"({len(back)} bytes, wrote {len(payload)}); the storage does not keep what is "
            "written to it"
        )


def check_root(
    root: str, options: StorageOptions, group: Any = None
) -> list[tuple[str, bool]] | None:
    """Fail early, on every rank together, when ``root`` cannot be used (collective).

    First the coordinator lists the root and refuses one that is, or is inside, a
    checkpoint (:func:`refuse_checkpoint_as_root`; nothing is created there). Then a
    local root is created and a probe is written, read back and deleted
    (:func:`probe_writable`: by every rank for a local root, which may be a per-node
    disk; by the coordinator for an object store, where the other ranks check that the
    bucket is reachable), every storage call bounded by the storage timeouts.
    Raises :class:`CheckpointDirError` naming the root and what to fix.

    Returns the coordinator's listing of the root (``Storage.list_dir``; None on the
    other ranks), so that a resume lists the root once: on a root of a thousand
    checkpoints each listing costs as much as the rest of a tiny resume (bench
    ``curves``; see BENCHMARKS.md).
    """
    coll = _dist.Collective(group)
    listing: list[list[tuple[str, bool]]] = []  # the coordinator's, when it could list

    def refuse() -> None:
        try:
            storage = Storage(root, options)
            entries = storage.list_dir()
        except Exception:  # unreachable: reported by check() below, with its cause
            return
        refuse_checkpoint_as_root(storage, entries)
        listing.append(entries)

    coll.on_coordinator(f"checking that {root} is not a checkpoint", refuse)

    def check() -> None:
        try:
            storage = Storage(root, options)
            local = storage.backend.scheme == "file"
            if local:
                os.makedirs(storage.root_path, exist_ok=True)
            if coll.is_coordinator and not listing:
                listing.append(storage.list_dir())  # raises why refuse() could not list
            storage.check_reachable()  # a missing bucket lists as empty
            if local or coll.is_coordinator:
                probe_writable(storage)
        except Exception as exc:  # any failure means the root is unusable
            raise CheckpointDirError(
                f"checkpoint root {root!r} is not reachable or writable: "
                f"{type(exc).__name__}: {exc} [fix the path/URL, the permissions or "
                "credentials, or free space]"
            ) from exc

    coll.on_every_rank(f"checking {root}", check)
    return listing[0] if coll.is_coordinator and listing else None
