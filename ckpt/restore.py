"""Load protocol: newest committed checkpoint that verifies and loads, else the one before.

Called by every rank (collective). For each candidate, newest first:

1. coordinator: read COMPLETE and manifest.json, fast-verify the files (sizes,
   and object crc32c where the backend reports it); broadcast the manifest or why
   the candidate is rejected;
2. every rank: ``dcp.load`` in place through :class:`~ckpt.reader.ShardReader`,
   which checks each item's crc32c before using it; DCP reshards to any world size.

A candidate that fails is reported (log + ``ckpt_fallback`` event naming the file
and the reason) and the previous committed checkpoint is tried. If committed
checkpoints exist but none loads, :class:`~ckpt.errors.NoLoadableCheckpointError`
is raised: nothing ever silently starts from scratch. A mismatch between the
state and the checkpoint (missing key, other shape) is the caller's problem, not
the checkpoint's, and is raised at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckpt import async_save as _async
from ckpt.commit import EventSink
from ckpt.discovery import CheckpointInfo, inspect_dir, list_checkpoints
from ckpt.dist import Collective
from ckpt.dist import quiet_single_process as _quiet_single_process
from ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NoLoadableCheckpointError,
    StateMismatchError,
    UncommittedCheckpointError,
)
from ckpt.layout import checkpoint_dirname
from ckpt.manifest import Manifest
from ckpt.quarantine import quarantine as quarantine_checkpoint
from ckpt.quarantine import should_quarantine
from ckpt.reader import SafeLoadPlanner, ShardReader
from ckpt.storage import Storage, StorageOptions
from ckpt.verify import verify_dir

logger = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class SkippedCheckpoint:
    """A committed checkpoint that load passed over, and why."""

    step: int
    url: str
    reason: str
    path: str = ""


@dataclass(slots=True, kw_only=True)
class LoadResult:
    """What :func:`load` loaded."""

    step: int
    url: str
    metadata: dict[str, Any]
    manifest: Manifest
    bytes_read: int
    duration_s: float
    skipped: list[SkippedCheckpoint] = field(default_factory=list)


def load(
    state: dict[str, Any],
    root: str,
    *,
    step: int | None = None,
    process_group: Any = None,
    missing_ok: bool = False,
    on_event: EventSink | None = None,
    storage_options: StorageOptions | None = None,
    quarantine: bool = True,
    _saver: _async.AsyncSaver | None = None,
) -> LoadResult | None:
    """Load ``state`` in place from the newest committed checkpoint under ``root``.

    Collective. With ``step``, only that checkpoint is tried (no fallback). With
    ``missing_ok``, returns None when ``root`` holds no committed checkpoint at all;
    otherwise raises :class:`~ckpt.errors.CheckpointNotFoundError`. With
    ``quarantine`` (the default), a committed checkpoint that fails verification is
    set aside by the coordinator before the fallback (:mod:`ckpt.quarantine`), so
    its step can be committed again instead of failing every later save.
    """
    if not isinstance(root, str):
        raise TypeError(f"root must be a str URL, got {type(root).__name__}")
    # A save still uploading in the background uses the same checkpoint group: finish it
    # first (and surface its error) so the two protocols never interleave.
    (_async.DEFAULT if _saver is None else _saver).wait_for_previous()
    started = time.monotonic()
    coll = Collective(process_group)
    storage = Storage(root, storage_options)
    storage.fault_registry.rank = coll.rank
    storage.fault_registry.step = None

    def discover() -> tuple[list[int], list[int]]:
        if step is not None:
            return [step], []
        infos = list_checkpoints(storage)
        if not infos:
            storage.check_reachable()  # a missing bucket is not an empty root
        return [i.step for i in infos if i.committed], [i.step for i in infos if not i.committed]

    candidates, partial = coll.on_coordinator(f"listing {root}", discover)
    if not candidates:
        if partial:
            logger.warning(
                "ckpt: %s holds %d partial checkpoint(s) (steps %s) and no committed one",
                root,
                len(partial),
                partial[:5],
            )
        if missing_ok:
            return None
        raise CheckpointNotFoundError(f"no committed checkpoint under {root}")

    skipped: list[SkippedCheckpoint] = []
    for candidate in candidates:
        dirname = checkpoint_dirname(candidate)
        ckpt_dir = storage.child(dirname)
        try:
            manifest = coll.on_coordinator(
                f"verifying {ckpt_dir.root_url}", lambda d=dirname: _verified_manifest(storage, d)
            )
            reader = ShardReader(ckpt_dir, manifest)
            coll.on_every_rank(f"reading {ckpt_dir.url('.metadata')}", reader.read_metadata)
            _dcp_load(state, reader, coll)
        except StateMismatchError:
            raise
        except CheckpointError as exc:
            if step is not None:
                raise
            reason = str(exc)
            skip = SkippedCheckpoint(
                step=candidate, url=ckpt_dir.root_url, reason=reason, path=getattr(exc, "path", "")
            )
            skipped.append(skip)
            if coll.is_coordinator:
                logger.error(
                    "ckpt: cannot use checkpoint %s: %s; falling back to the previous one",
                    skip.url,
                    reason,
                )
            if on_event is not None:
                on_event(
                    {
                        "event": "ckpt_fallback",
                        "step": skip.step,
                        "url": skip.url,
                        "path": skip.path,
                        "reason": reason,
                    }
                )
            if quarantine and should_quarantine(exc):
                _set_aside(storage, coll, skip, on_event)
            continue
        duration = time.monotonic() - started
        bytes_read = reader.bytes_read
        if coll.is_coordinator:
            logger.info(
                "ckpt: loaded step %d from %s (world size %d -> %d, %.2f s)",
                candidate,
                ckpt_dir.root_url,
                manifest.world_size,
                coll.world_size,
                duration,
            )
        if on_event is not None:
            on_event(
                {
                    "event": "ckpt_loaded",
                    "step": candidate,
                    "url": ckpt_dir.root_url,
                    "bytes": bytes_read,
                    "duration_s": round(duration, 4),
                    "saved_world_size": manifest.world_size,
                    "world_size": coll.world_size,
                }
            )
        return LoadResult(
            step=candidate,
            url=ckpt_dir.root_url,
            metadata=dict(manifest.metadata),
            manifest=manifest,
            bytes_read=bytes_read,
            duration_s=duration,
            skipped=skipped,
        )
    reasons = [(s.step, s.reason) for s in skipped]
    listing = "; ".join(f"step {s}: {r}" for s, r in reasons)
    raise NoLoadableCheckpointError(
        f"{root} has {len(candidates)} committed checkpoint(s) but none could be loaded "
        f"({listing}). Nothing was started from scratch; inspect them with "
        f"`python -m ckpt verify --deep {root}`.",
        reasons,
    )


def _set_aside(
    storage: Storage, coll: Collective, skip: SkippedCheckpoint, on_event: EventSink | None
) -> None:
    """Quarantine a checkpoint every rank failed to load (the coordinator moves it)."""

    def move() -> str:
        try:
            kept = quarantine_checkpoint(storage, skip.step, skip.reason, skip.path)
        except CheckpointError as exc:  # the fallback goes on; the next resume tries again
            logger.error("ckpt: could not quarantine %s: %s", skip.url, exc)
            return ""
        logger.warning(
            "ckpt: quarantined %s (%s); its files are kept at %s, step %d can be saved again "
            "(`python -m ckpt gc --quarantined` removes them)",
            skip.url,
            skip.reason,
            kept.url,
            skip.step,
        )
        return kept.url

    kept_at = coll.on_coordinator(f"quarantining {skip.url}", move)
    if kept_at and on_event is not None:
        on_event(
            {
                "event": "ckpt_quarantined",
                "step": skip.step,
                "url": skip.url,
                "kept_at": kept_at,
                "path": skip.path,
                "reason": skip.reason,
            }
        )


def _verified_manifest(storage: Storage, dirname: str) -> Manifest:
    info: CheckpointInfo = inspect_dir(storage, dirname)
    if not info.committed or info.manifest is None:
        # Gone or changed since listing (pruned): skipped, but nothing to quarantine.
        raise UncommittedCheckpointError(
            f"{info.url} is not committed: {info.reason}", url=info.url
        )
    verify_dir(storage.child(dirname), info.manifest).raise_if_bad()
    return info.manifest


def _dcp_load(state: dict[str, Any], reader: ShardReader, coll: Collective) -> None:
    try:
        with _quiet_single_process():
            dcp.load(
                state,
                storage_reader=reader,
                planner=SafeLoadPlanner(),
                process_group=coll.group,
                no_dist=not coll.distributed,
            )
    except CheckpointException as exc:
        errors = [err for err, _ in exc.failures.values()]
        for err in errors:
            if isinstance(err, StateMismatchError):
                raise StateMismatchError(str(err)) from None
        # The first error that names a file wins; any failure rejects this checkpoint.
        first = next((e for e in errors if getattr(e, "path", "")), errors[0] if errors else exc)
        message = (
            str(first)
            if isinstance(first, CheckpointError)
            else (f"{reader.ckpt_dir.root_url}: loading failed: {type(first).__name__}: {first}")
        )
        raise CorruptCheckpointError(
            message, url=reader.ckpt_dir.root_url, path=getattr(first, "path", "")
        ) from None
    except CheckpointError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{reader.ckpt_dir.root_url}: loading failed on rank {coll.rank}: "
            f"{type(exc).__name__}: {exc}",
            url=reader.ckpt_dir.root_url,
        ) from exc
