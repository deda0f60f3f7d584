"""Discovery: which checkpoints exist under a root, and which of them are committed.

A directory counts as committed only if its COMPLETE marker parses, names the
directory's step, and vouches for the exact bytes of its manifest.json (crc32c).
Everything else is *partial*: invisible to resume and retention counting, shown
as such by ``python -m ckpt ls``. A directory without COMPLETE but with a
QUARANTINED record is *quarantined* (:mod:`ckpt.root.quarantine`, a move interrupted
half-way): never resumed, never deleted by retention or a new save's clean-up.
*corrupt* is a committed one that an operation failed to verify or load and did not
quarantine (:meth:`Catalog.mark`). *renamed* is a committed checkpoint under another
step's name (its COMPLETE and manifest agree on a step the name does not say): never
resumed, never deleted, set aside by the operations that would have cleared it.
*damaged* is a committed checkpoint whose manifest.json was damaged after its commit:
COMPLETE is present and parses, but manifest.json is missing, unreadable, larger than
the limit, fails to parse, or is not the exact bytes COMPLETE vouches for. COMPLETE is
written only after manifest.json is durable and is the first file removed by every
deletion and quarantine, so no save in flight and no deletion leaves that state: it is
damage, not a partial save. Never resumed and never deleted: a resume reports it and
quarantines it like a checkpoint whose shard fails its crc32c, and retention and a
save of its step set it aside the same way. One operation lists the root once into a
:class:`Catalog` and passes it down.

Everything read here is untrusted input: COMPLETE and manifest.json are read with size
limits and parsed with checks; an entry named like a checkpoint that is not a directory
(a plain file, a symbolic link, which is never followed) is *foreign*
(:meth:`Catalog.foreign`): listed, never read through, never deleted. The root's owner
lease records (:func:`ckpt.format.layout.is_lease_name`) are not checkpoints and are not listed
here (``python -m ckpt ls`` shows the lease itself).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from ckpt.errors import (
    CheckpointDirError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StorageError,
)
from ckpt.format.layout import (
    COMPLETE_NAME,
    MANIFEST_NAME,
    QUARANTINE_MARKER_NAME,
    STOCK_DCP_DIR_RE,
    STOCK_DCP_REASON,
    checkpoint_dirname,
    is_stock_dcp,
    parse_checkpoint_dirname,
)
from ckpt.format.manager_record import record_problems
from ckpt.format.manifest import MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, CompleteMarker, Manifest
from ckpt.root.quarantine import (
    QuarantinedCheckpoint,
    list_quarantined,
    parse_quarantined_dirname,
)
from ckpt.root.quarantine import read_record as read_quarantine_record
from ckpt.storage import DIR, LINK, Storage

logger = logging.getLogger(__name__)

COMMITTED = "committed"
PARTIAL = "partial"
CORRUPT = "corrupt"
"""Committed, but this operation failed to verify or load it (quarantine turned off)."""
REFUSED = "refused"
"""Committed, but this job's objects refused its values (a resume then tries the older
ones; whether it was damaged is decided by whether an older one applies)."""
QUARANTINED = "quarantined"
FOREIGN = "foreign"
"""Named like a checkpoint but not a directory of ours: a symbolic link, a plain file."""
RENAMED = "renamed"
"""A committed checkpoint whose directory name says another step (renamed by hand)."""
DAMAGED = "damaged"
"""COMPLETE present and valid, manifest.json not what it vouches for: damaged after commit."""
SET_ASIDE = (RENAMED, DAMAGED)
"""Statuses of committed checkpoints that are never loaded nor deleted, only quarantined."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ForeignEntry:
    """An entry of a root named like a checkpoint that is not a directory of ours."""

    name: str
    url: str
    kind: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointInfo:
    """One checkpoint directory under a root, as discovery sees it."""

    step: int
    url: str
    dirname: str
    status: str
    reason: str = ""
    marker: CompleteMarker | None = None
    manifest: Manifest | None = None

    @property
    def committed(self) -> bool:
        return self.status == COMMITTED


def as_storage(root: str | Storage) -> Storage:
    return root if isinstance(root, Storage) else Storage(root)


def inspect_dir(storage: Storage, dirname: str) -> CheckpointInfo:
    """Classify one checkpoint directory (reads COMPLETE and manifest.json)."""
    step = parse_checkpoint_dirname(dirname)
    if step is None:
        raise ValueError(f"{storage.url(dirname)} is not a checkpoint directory name")
    url = storage.url(dirname)

    def found(status: str, reason: str, **kw: Any) -> CheckpointInfo:
        return CheckpointInfo(
            step=step, url=url, dirname=dirname, status=status, reason=reason, **kw
        )

    def partial(reason: str, marker: CompleteMarker | None = None) -> CheckpointInfo:
        return found(PARTIAL, reason, marker=marker)

    def damaged(problem: str, marker: CompleteMarker) -> CheckpointInfo:
        named = "" if marker.step == step else f" (COMPLETE names step {marker.step})"
        return found(
            DAMAGED,
            f"damaged after its commit: COMPLETE is present{named} but {problem}",
            marker=marker,
        )

    kind = storage.local_kind(dirname)
    if kind not in (None, DIR):
        what = "a symbolic link" if kind == LINK else f"a {kind}, not a directory"
        return found(FOREIGN, f"{what}: not read, never followed or deleted")

    try:
        raw_marker = storage.read_bytes(f"{dirname}/{COMPLETE_NAME}", max_bytes=MAX_MARKER_BYTES)
    except ObjectTooLargeError:
        return partial(f"COMPLETE is larger than the {MAX_MARKER_BYTES} bytes of a marker")
    except ObjectNotFoundError:
        if storage.exists(f"{dirname}/{QUARANTINE_MARKER_NAME}"):
            reason = read_quarantine_record(storage, dirname).get("reason", "no reason recorded")
            return found(
                QUARANTINED, f"quarantined (move to a .quarantined- name unfinished): {reason}"
            )
        if _stock_dcp(storage, dirname):
            return found(FOREIGN, STOCK_DCP_REASON)
        return partial("no COMPLETE marker (save interrupted or in progress)")
    try:
        marker = CompleteMarker.from_bytes(raw_marker, url=url)
    except CorruptCheckpointError as exc:
        return partial(str(exc))
    try:
        raw_manifest = storage.read_bytes(
            f"{dirname}/{MANIFEST_NAME}", max_bytes=MAX_MANIFEST_BYTES
        )
    except ObjectTooLargeError:
        return damaged(f"manifest.json is larger than {MAX_MANIFEST_BYTES} bytes", marker)
    except ObjectNotFoundError:
        if not storage.exists(f"{dirname}/{COMPLETE_NAME}"):
            return partial("removed while being listed (COMPLETE and manifest.json gone)")
        return damaged("manifest.json is missing", marker)
    if not marker.vouches_for(raw_manifest):
        return damaged(
            f"manifest.json ({len(raw_manifest)} bytes) is not the one it was committed with "
            "(crc32c differs: truncated or changed since)",
            marker,
        )
    try:
        manifest = Manifest.from_bytes(raw_manifest, url=url)
    except CorruptCheckpointError as exc:
        return damaged(f"manifest.json does not parse ({exc})", marker)
    malformed = record_problems(manifest.metadata)
    if manifest.world_size < 1:
        malformed.insert(0, f"world_size is {manifest.world_size}")
    if malformed:
        return found(
            DAMAGED,
            f"malformed: its manifest's {'; '.join(malformed)} (written so, or forged): never "
            "used",
            marker=marker,
        )
    if manifest.step != step or marker.step != step:
        if manifest.step == marker.step:
            return found(
                RENAMED,
                f"renamed: it holds the committed checkpoint of step {marker.step}",
                marker=marker,
                manifest=manifest,
            )
        return partial(
            f"COMPLETE names step {marker.step}, manifest step {manifest.step}, directory is "
            f"step {step}",
            marker,
        )
    return found(COMMITTED, "", marker=marker, manifest=manifest)


class Catalog:
    """One listing of a root for one operation, its directories inspected lazily, newest first.

    A resume, a save's preparation or a CLI call lists the root once into a catalog and
    passes it down (Orbax's ``CheckpointManager`` keeps its checkpoints the same way),
    instead of each step listing the root again and re-reading every manifest: a resume
    reads COMPLETE and manifest.json of the checkpoint it loads, and of older ones only
    when it falls back to them. A snapshot: what changed on storage after the listing is
    seen only through :meth:`mark` (quarantine, a failed verification) or a new catalog.
    Used by one process (the coordinator of the operation); not thread-safe.
    """

    def __init__(self, root: str | Storage, entries: list[tuple[str, str]] | None = None):
        self.storage = as_storage(root)
        self._entries = entries
        self._infos: dict[int, CheckpointInfo] = {}
        self._marks: dict[int, tuple[str, str]] = {}

    @property
    def entries(self) -> list[tuple[str, str]]:
        """The root's listing (``Storage.list_dir``), made on first use."""
        if self._entries is None:
            self._entries = self.storage.list_dir()
        return self._entries

    def steps(self) -> list[int]:
        """Steps of every checkpoint directory in the listing, newest first."""
        return sorted(
            (
                s
                for name, kind in self.entries
                if kind == DIR and (s := parse_checkpoint_dirname(name)) is not None
            ),
            reverse=True,
        )

    def foreign(self) -> list[ForeignEntry]:
        """Entries named like a checkpoint (or a quarantined one) that are not directories:
        a plain file, a symbolic link (never followed), anything else. Never read, never
        deleted; listed so that a user sees them."""
        out = []
        for name, kind in sorted(self.entries, reverse=True):
            if kind == DIR:
                if STOCK_DCP_DIR_RE.match(name) and _stock_dcp(self.storage, name):
                    url = self.storage.url(name)
                    out.append(ForeignEntry(name=name, url=url, kind=DIR, reason=STOCK_DCP_REASON))
                continue
            if parse_checkpoint_dirname(name) is None and parse_quarantined_dirname(name) is None:
                continue
            what = "a symbolic link" if kind == LINK else f"a {kind}, not a directory"
            out.append(
                ForeignEntry(
                    name=name,
                    url=self.storage.url(name),
                    kind=kind,
                    reason=f"{what}: not a checkpoint of this root (never followed or deleted)",
                )
            )
        return out

    def has(self, step: int) -> bool:
        """Whether the listing holds a directory for ``step``."""
        return step in self._infos or step in set(self.steps())

    def info(self, step: int, *, chunks: bool = False) -> CheckpointInfo:
        """The checkpoint of ``step`` (COMPLETE and manifest.json read once, then kept).

        Only the checkpoint inspected last keeps its manifest's per-item ``chunks``; the
        others keep a summary (:meth:`Manifest.summary`). A manifest may hold millions of
        entries (about 1 GB parsed at the size limit, or padded by whoever can write to
        the root): walking a root of many holds one at a time, not all of them.
        ``chunks=True`` (to load or verify it): read it again if only its summary is left.
        """
        cached = self._infos.get(step)
        manifest = cached.manifest if cached is not None else None
        if cached is None or (chunks and manifest is not None and manifest.chunks_dropped):
            self._drop_chunks()  # before parsing the next: one parsed manifest at a time
            fresh = inspect_dir(self.storage, checkpoint_dirname(step))
            mark = self._marks.get(step)
            self._infos[step] = replace(fresh, status=mark[0], reason=mark[1]) if mark else fresh
        return self._infos[step]

    def _drop_chunks(self) -> None:
        for step, info in self._infos.items():
            if info.manifest is not None and not info.manifest.chunks_dropped:
                self._infos[step] = _summary(info)

    def __iter__(self) -> Iterator[CheckpointInfo]:
        """Every checkpoint directory, newest first, inspected as the iteration reaches it;
        each as a summary (no per-item chunks: ``info(step, chunks=True)`` has them)."""
        return (_summary(self.info(step)) for step in self.steps())

    def latest_committed(self) -> CheckpointInfo | None:
        """The newest committed checkpoint (with its chunks), or None; reads only down to it."""
        for step in self.steps():
            info = self.info(step)
            if info.committed:
                return info
            logger.debug("ckpt: skipping %s: %s", info.url, info.reason)
        return None

    def mark(self, step: int, status: str, reason: str) -> None:
        """Record what this operation learned about ``step`` (quarantined, corrupt)."""
        self._marks[step] = (status, reason)
        self._infos[step] = replace(self.info(step), status=status, reason=reason)

    def quarantined(self) -> list[QuarantinedCheckpoint]:
        """Checkpoints already moved aside under a ``.quarantined-`` name (newest first)."""
        return list_quarantined(self.storage, self.entries)


def _stock_dcp(storage: Storage, dirname: str) -> bool:
    """Whether ``dirname`` holds a checkpoint of stock ``dcp.save`` (listed; nothing read)."""
    try:
        return is_stock_dcp(storage.list_files(dirname))
    except (OSError, StorageError):
        return False


def stock_dcp_names(catalog: Catalog) -> list[str]:
    """Names of the stock DCP checkpoints under the catalog's root (``checkpoint_N`` or
    torchtitan's ``step-N``), newest first: what a resume that finds nothing of ours names."""
    names = [e.name for e in catalog.foreign() if e.reason == STOCK_DCP_REASON]
    names += [i.dirname for i in catalog if i.reason == STOCK_DCP_REASON]
    return names


def _summary(info: CheckpointInfo) -> CheckpointInfo:
    if info.manifest is None or info.manifest.chunks_dropped:
        return info
    return replace(info, manifest=info.manifest.summary())


def list_checkpoints(
    root: str | Storage, entries: list[tuple[str, str]] | None = None
) -> list[CheckpointInfo]:
    """Every checkpoint directory under ``root``, committed and partial, newest first.

    ``entries``: the root's listing when the caller already has it (one listing per
    operation).
    """
    return list(Catalog(root, entries))


def committed_checkpoints(root: str | Storage) -> list[CheckpointInfo]:
    """Committed checkpoints under ``root``, newest first."""
    return [info for info in list_checkpoints(root) if info.committed]


def find_latest_committed(root: str | Storage) -> CheckpointInfo | None:
    """The newest committed checkpoint under ``root``, or None.

    Walks directories newest first and stops at the first committed one, so it
    reads only what it must.
    """
    return Catalog(root).latest_committed()


def resolve(url: str, step: int | None = None) -> tuple[Storage, CheckpointInfo]:
    """Resolve a root URL (+ optional step) or a checkpoint directory URL to one checkpoint.

    Without a step, a root resolves to its newest committed checkpoint.
    """
    stripped = url.rstrip("/")
    dir_step = parse_checkpoint_dirname(stripped)
    if dir_step is not None and "/" in stripped:
        parent, dirname = stripped.rsplit("/", 1)
        if step is not None and step != dir_step:
            raise ValueError(f"{url} is the checkpoint of step {dir_step}, not step {step}")
        storage = Storage(parent or "/")
        return storage, inspect_dir(storage, dirname)
    storage = require_root(url)
    if step is not None:
        if checkpoint_dirname(step) not in {name for name, _ in storage.list_dir()}:
            committed = [info.step for info in Catalog(storage) if info.committed]
            raise CheckpointNotFoundError(
                f"no checkpoint of step {step} under {url}; committed steps: "
                + (", ".join(map(str, sorted(committed))) if committed else "none")
            )
        return storage, inspect_dir(storage, checkpoint_dirname(step))
    latest = find_latest_committed(storage)
    if latest is None:
        raise CheckpointNotFoundError(f"no committed checkpoint under {url}")
    return storage, latest


def require_root(url: str) -> Storage:
    """The storage of root ``url``; a local root that does not exist is an error naming it
    (a typo in a path is not "no checkpoints")."""
    storage = Storage(url)
    if storage.backend.scheme == "file" and not os.path.isdir(storage.path()):
        what = "is not a directory" if os.path.lexists(storage.path()) else "does not exist"
        raise CheckpointDirError(f"checkpoint root {url!r} {what}")
    return storage
