"""Files of the memory tier on a node: names, the commit record, slots (no collectives).

    <base>/<run key>/h{rank:05d}/slot{0,1}/
        rank_{R:05d}.distcp      the holder's own shard (DCP format: ckpt/tiers/memory/shard.py)
        rank_{S:05d}.distcp      replicas it received from ranks on another node
        .metadata                DCP metadata of the whole snapshot
        manifest.json            every file with size and crc32c, every item's crc32c
        COMMIT                   written last: a COMPLETE marker (step, attempt, crc32c of
                                 manifest.json); a slot without a valid one is ignored

``<base>`` is ``memory_dir``, else ``CKPT_MEMORY_DIR``, else ``/dev/shm/ckpt-memory-<uid>``;
``<run key>`` is torchrun's run id plus a hash of the checkpoint root, so another launch
(a new ``--rdzv_id``) or another root never sees these snapshots.

The base is trusted only when it is this user's (:func:`secure_base_dir`): created with
mode 0700, or an existing directory (not a symbolic link) owned by this user and not
writable by group or others, in a parent that others cannot rename it in. Otherwise
another local user could replace the snapshots a restart loads. Files are opened with
:func:`open_private` (no symbolic link, a regular file of this user's) before use.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass

from ckpt import env
from ckpt.errors import CheckpointError
from ckpt.format.layout import MANIFEST_NAME
from ckpt.format.manifest import MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, CompleteMarker, Manifest
from ckpt.tiers.memory import shard

logger = logging.getLogger(__name__)

ENV_MEMORY_DIR = env.MEMORY_DIR
DEFAULT_MEMORY_DIR = f"/dev/shm/ckpt-memory-{os.geteuid()}"
"""One directory per user: a shared one would be trusted by whoever came second."""
COMMIT_NAME = "COMMIT"
SLOTS = 2


class MemoryDirError(CheckpointError):
    """The memory tier's directory is not safely this user's (owner, mode, a link)."""


def memory_base_dir(memory_dir: str | None = None) -> str:
    """Where memory snapshots live: ``memory_dir``, ``CKPT_MEMORY_DIR``, or /dev/shm."""
    return os.path.abspath(memory_dir or env.get_str(ENV_MEMORY_DIR, DEFAULT_MEMORY_DIR))


FALLBACK_DIRS = 8
"""Numbered alternatives of the default directory tried when another user holds it."""


def fallback_dirs() -> list[str]:
    """Where the memory tier goes when the default directory is another user's, in order:
    ``$XDG_RUNTIME_DIR/ckpt-memory`` (the per-user tmpfs a login session has, which no
    other user can create), then ``<default>-1`` .. ``<default>-8``. A restart walks the
    same list, so it finds the snapshots the previous attempt left."""
    out = []
    runtime = env.get_str(env.XDG_RUNTIME_DIR, "")
    if runtime and os.path.isabs(runtime):
        out.append(os.path.join(runtime, "ckpt-memory"))
    out += [f"{DEFAULT_MEMORY_DIR}-{i}" for i in range(1, FALLBACK_DIRS + 1)]
    return out


def choose_memory_dir(memory_dir: str | None = None) -> str:
    """The memory tier's directory, checked (:func:`secure_base_dir`). One the user named
    (``memory_dir``, ``CKPT_MEMORY_DIR``) is used or refused; the default, when another
    user took it first (any local user can create ``/dev/shm/ckpt-memory-<uid>``), gives
    way to the first of :func:`fallback_dirs` that is safely ours, said at WARNING, so a
    squatter cannot stop this user's jobs."""
    base = memory_base_dir(memory_dir)
    if memory_dir or env.get_str(ENV_MEMORY_DIR, ""):
        secure_base_dir(base)
        return base
    try:
        secure_base_dir(base)
        return base
    except MemoryDirError as first:
        for candidate in fallback_dirs():
            try:
                secure_base_dir(candidate)
            except MemoryDirError:
                continue
            logger.warning(
                "ckpt memory tier: %s; using %s instead (a restart finds it there too)",
                first, candidate,
            )  # fmt: skip
            return candidate
        raise


def secure_base_dir(base: str) -> None:
    """Create ``base`` for this user (mode 0700), or check that an existing one is safe.

    Refused, with :class:`MemoryDirError` naming the directory and the fix: a symbolic
    link, something not a directory, a directory of another user or writable by group or
    others, or one inside a directory where others may rename entries (writable by them
    without the sticky bit).
    """
    uid = os.geteuid()
    fix = (
        f"set {ENV_MEMORY_DIR} (or memory_dir=) to a directory of your own, e.g. "
        f"{DEFAULT_MEMORY_DIR}, or remove {base} if it is yours"
    )
    parent = os.path.dirname(base.rstrip("/")) or "/"
    try:
        if not os.path.isdir(parent):
            os.makedirs(parent, mode=0o700, exist_ok=True)
        pst = os.stat(parent)
    except OSError as exc:
        raise MemoryDirError(f"memory tier directory {base}: {parent}: {exc}; {fix}") from exc
    if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX and pst.st_uid not in (0, uid):
        raise MemoryDirError(
            f"memory tier directory {base} is inside {parent}, which other users may write "
            f"to without the sticky bit (they could replace it); {fix}"
        )
    try:
        if not os.path.lexists(base):
            os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise MemoryDirError(
            f"memory tier directory {base}: cannot create it ({exc}); {fix}"
        ) from exc
    st = os.lstat(base)
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != uid:
        problem = f"belongs to uid {st.st_uid}, not to this user (uid {uid})"
    elif st.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    else:
        return
    raise MemoryDirError(
        f"memory tier directory {base} {problem}: another user could replace the snapshots "
        f"a restart loads; {fix}"
    )


def open_private(path: str) -> int:
    """Open a memory-tier file for reading: a regular file of this user's, not writable by
    group or others, never through a symbolic link. Returns the descriptor; raises
    ``OSError`` otherwise (the caller treats the file as unusable)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise PermissionError(f"{path} is not a private regular file of this user's")
    return fd


def read_private(path: str, limit: int | None = None) -> bytes:
    """The bytes of a memory-tier file opened with :func:`open_private` (up to ``limit``+1)."""
    with os.fdopen(open_private(path), "rb") as f:
        return f.read() if limit is None else f.read(limit + 1)


def run_key(run_id: str, root: str) -> str:
    """Directory name of one run's snapshots under the base: run id + hash of the root."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:64] or "run"
    return f"{safe}-{hashlib.sha1(root.encode()).hexdigest()[:10]}"


@dataclass(slots=True)
class SlotInfo:
    """A committed slot as read back from disk."""

    step: int
    save_id: str
    restart_count: int


def compact_manifest(manifest: Manifest) -> bytes:
    """``manifest.json`` without indentation: ``Manifest.to_bytes`` indents, which makes
    ``json`` use its pure-Python encoder (milliseconds for the chunks of a snapshot, at
    every snapshot). The same fields; ``Manifest.from_bytes`` reads either."""
    data = json.loads(Manifest.to_bytes(_empty_like(manifest)))
    data["files"] = [{"path": e.path, "size": e.size, "crc32c": e.crc32c} for e in manifest.files]
    data["chunks"] = manifest.chunks
    data["metadata"] = manifest.metadata
    return (json.dumps(data, separators=(",", ":")) + "\n").encode("utf-8")


def _empty_like(manifest: Manifest) -> Manifest:
    return dataclasses.replace(manifest, files=[], chunks={}, metadata={})


def pick_slot(slots: list[SlotInfo | None]) -> int:
    """The slot to overwrite: never the one holding the newest committed snapshot."""
    committed = [(info.step, i) for i, info in enumerate(slots) if info is not None]
    if not committed:
        return 0
    newest = max(committed)[1]
    return (newest + 1) % SLOTS


def read_slot(slot_dir: str) -> SlotInfo | None:
    """The committed snapshot in a slot, or None (no valid COMMIT vouching for the manifest)."""
    loaded = read_commit(slot_dir)
    if isinstance(loaded, str):
        return None
    marker, _, _ = loaded
    return SlotInfo(marker.step, marker.attempt.save_id, marker.attempt.restart_count)


def read_commit(slot_dir: str) -> tuple[CompleteMarker, Manifest, bytes] | str:
    """``(marker, manifest, manifest bytes)`` of a committed slot, else why it is not one."""
    try:
        raw_marker = read_private(os.path.join(slot_dir, COMMIT_NAME), MAX_MARKER_BYTES)
    except OSError:
        return "no COMMIT record (snapshot interrupted or overwritten)"
    try:
        marker = CompleteMarker.from_bytes(raw_marker, url=slot_dir)
        raw_manifest = read_private(os.path.join(slot_dir, MANIFEST_NAME), MAX_MANIFEST_BYTES)
        if not marker.vouches_for(raw_manifest):
            return "COMMIT does not match manifest.json (crc32c differs)"
        manifest = Manifest.from_bytes(raw_manifest, url=slot_dir)
    except (OSError, CheckpointError) as exc:
        return f"unreadable commit record: {exc}"
    if manifest.step != marker.step:
        return f"COMMIT names step {marker.step}, manifest step {manifest.step}"
    return marker, manifest, raw_manifest


def remove_slot(slot_dir: str) -> None:
    unlink(os.path.join(slot_dir, COMMIT_NAME))  # invalid first, then gone
    shutil.rmtree(slot_dir, ignore_errors=True)


def remove_other_launches(base: str, keep: str) -> None:
    """Snapshots of the same root from an earlier launch (another run id) are unusable."""
    suffix = keep.rsplit("-", 1)[-1]
    for name in listdir(base):
        if name != keep and name.endswith(f"-{suffix}"):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def write_file(path: str, data: bytes) -> None:
    with shard.ShardFile(path) as out:
        out.write(data)
        out.finish(len(data))


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
