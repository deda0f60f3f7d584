"""Load protocol: newest committed checkpoint that verifies and loads, else the one before.

Called by every rank (collective). For each candidate, newest first:

1. coordinator: read COMPLETE and manifest.json, fast-verify the files (sizes,
   and object crc32c where the backend reports it); broadcast the manifest or why
   the candidate is rejected;
2. every rank: DCP's load protocol in place (:func:`~ckpt.loading.planning.load_state`:
   plans exchanged only for read-once sharing) through
   :class:`~ckpt.loading.reader.ShardReader`, which checks each item's crc32c before
   using it; DCP's planner reshards to any world size.

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

from torch.distributed.checkpoint.api import CheckpointException

from ckpt.dist import Collective
from ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointUnreadableError,
    CorruptCheckpointError,
    NoLoadableCheckpointError,
    StateMismatchError,
    UncommittedCheckpointError,
)
from ckpt.format.layout import checkpoint_dirname
from ckpt.format.manifest import Manifest
from ckpt.loading.planning import load_state
from ckpt.loading.reader import SafeLoadPlanner, ShardReader
from ckpt.loading.verify import verify_dir
from ckpt.root.catalog import CORRUPT, DAMAGED, QUARANTINED, Catalog
from ckpt.root.quarantine import quarantine as quarantine_checkpoint
from ckpt.root.quarantine import should_quarantine
from ckpt.saving.session import EventSink, Session, default_session
from ckpt.state.state_check import LoadableState
from ckpt.storage import Storage, StorageOptions
from runcore import events as ev

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
    not_loaded: list[str] = field(default_factory=list)
    """Checkpoint keys under a top-level key of the state that the state had no place for
    (e.g. ``optim.state.0.exp_avg`` for a never-stepped optimizer's ``state_dict()``):
    left in the checkpoint, and said at WARNING. Top-level keys the state does not have
    are not listed."""


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
    catalog: Catalog | None = None,
) -> LoadResult | None:
    """Load ``state`` in place from the newest committed checkpoint under ``root``.

    Collective. With ``step``, only that checkpoint is tried (no fallback). With
    ``missing_ok``, returns None when ``root`` holds no committed checkpoint at all;
    otherwise raises :class:`~ckpt.errors.CheckpointNotFoundError`. With
    ``quarantine`` (the default), a committed checkpoint found damaged is set aside
    by the coordinator before the fallback (:mod:`ckpt.root.quarantine`), so its step can
    be committed again instead of failing every later save; a root left with
    quarantined checkpoints and no committed one raises
    :class:`~ckpt.errors.NoLoadableCheckpointError` even with ``missing_ok``.
    ``catalog``: the coordinator's listing of ``root`` when the caller already made
    one (:class:`~ckpt.root.catalog.Catalog`; what it read is not read again); other
    ranks ignore it. Without it, the coordinator lists ``root`` once.

    ``state`` holds state dicts or the objects themselves (anything with
    ``state_dict()``/``load_state_dict()``: those are called around the load). Pass an
    optimizer as the object: one that has not stepped yet is given the state its first
    ``step()`` creates before the load (``Adam``/``AdamW``: zeros, no step run), so it
    takes the checkpoint's state; its bare ``state_dict()`` has no place for that state.
    Values the checkpoint holds under a key of ``state`` that ``state`` has no place for
    are not loaded: they are listed in :attr:`LoadResult.not_loaded` and said at WARNING.
    """
    return load_in(
        default_session(
            process_group=process_group, storage_options=storage_options, on_event=on_event
        ),
        state,
        root,
        step=step,
        missing_ok=missing_ok,
        quarantine=quarantine,
        catalog=catalog,
    )


def load_in(
    session: Session,
    state: dict[str, Any],
    root: str,
    *,
    step: int | None = None,
    missing_ok: bool = False,
    quarantine: bool = True,
    catalog: Catalog | None = None,
) -> LoadResult | None:
    """:func:`load` in ``session`` (its saver, process group, storage options, events;
    with ``session.partial_templates``, keys a template has no place for are not listed
    as not loaded)."""
    if not isinstance(root, str):
        raise TypeError(f"root must be a str URL, got {type(root).__name__}")
    # A save still uploading in the background uses the same checkpoint group: finish it
    # first (and surface its error) so the two protocols never interleave.
    session.saver.wait_for_previous()
    on_event = session.on_event
    started = time.monotonic()
    coll = Collective(session.process_group)
    storage = Storage(root, session.storage_options)
    storage.faults.rank = coll.rank
    storage.faults.step = None

    loadable = LoadableState(state)  # numpy values as they were saved, Statefuls resolved
    # Only the coordinator lists and reads COMPLETE/manifest.json; the others follow.
    cat = catalog if catalog is not None and coll.is_coordinator else Catalog(storage)

    def discover() -> list[int]:
        if step is not None:
            return [step]
        steps = cat.steps()
        if not steps:
            storage.check_reachable()  # a missing bucket is not an empty root
        return steps

    candidates = coll.on_coordinator(f"listing {root}", discover)
    skipped: list[SkippedCheckpoint] = []
    uncommitted: list[int] = []
    for candidate in candidates:
        dirname = checkpoint_dirname(candidate)
        ckpt_dir = storage.child(dirname)
        try:
            manifest = coll.on_coordinator(
                f"verifying {ckpt_dir.root_url}", lambda c=candidate: _verified_manifest(cat, c)
            )
            if manifest is None:  # partial or quarantined: never a candidate
                if step is not None:
                    raise UncommittedCheckpointError(
                        f"{ckpt_dir.root_url} is not a committed checkpoint", url=ckpt_dir.root_url
                    )
                uncommitted.append(candidate)
                continue
            reader = ShardReader(ckpt_dir, manifest, collective=coll)
            # Every rank reads (and keeps) the metadata; only the outcome travels (the
            # Metadata itself, gathered, was pickled to every rank world-size times).
            coll.on_every_rank(
                f"reading {ckpt_dir.url('.metadata')}", lambda r=reader: _read_metadata(r)
            )
            stored = reader.read_metadata().state_dict_metadata
            loadable.make_room(stored)
            not_loaded = [] if session.partial_templates else loadable.not_loaded(stored)
            _dcp_load(loadable.plain, reader, coll)
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
                        "event": ev.CKPT_FALLBACK,
                        "step": skip.step,
                        "url": skip.url,
                        "path": skip.path,
                        "reason": reason,
                    }
                )
            if quarantine and should_quarantine(exc):
                set_aside(cat, coll, skip, on_event)
            elif coll.is_coordinator:
                cat.mark(candidate, CORRUPT, reason)
            continue
        loadable.finish()
        duration = time.monotonic() - started
        bytes_read = reader.bytes_read
        if not_loaded and coll.is_coordinator:
            _say_not_loaded(not_loaded, ckpt_dir.root_url)
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
                    "event": ev.CKPT_LOADED,
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
            not_loaded=not_loaded,
        )
    if not skipped:
        refuse_only_quarantined(coll, cat, root)
        if uncommitted and coll.is_coordinator:
            logger.warning(
                "ckpt: %s holds %d partial checkpoint(s) (steps %s) and no committed one",
                root,
                len(uncommitted),
                uncommitted[:5],
            )
        if missing_ok:
            return None
        raise CheckpointNotFoundError(f"no committed checkpoint under {root}")
    reasons = [(s.step, s.reason) for s in skipped]
    listing = "; ".join(f"step {s}: {r}" for s, r in reasons)
    raise NoLoadableCheckpointError(
        f"{root} has {len(skipped)} committed checkpoint(s) but none could be loaded "
        f"({listing}). Nothing was started from scratch; inspect them with "
        f"`python -m ckpt verify --deep {root}`.",
        reasons,
    )


def _say_not_loaded(not_loaded: list[str], url: str) -> None:
    """WARNING: values of the checkpoint the state had no place for (the usual cause: an
    optimizer's ``state_dict()`` before its first ``step()``)."""
    listed = ", ".join(not_loaded[:5]) + (" ..." if len(not_loaded) > 5 else "")
    logger.warning(
        "ckpt: %d value(s) of %s under the keys you passed were NOT loaded: the state to "
        "load has no place for them (%s). A never-stepped optimizer's state_dict() has no "
        "'state' entries: pass the optimizer object itself (ckpt.load({'optim': optimizer, "
        "...}, root)) or a template from torch.distributed.checkpoint.state_dict."
        "get_state_dict; LoadResult.not_loaded lists them all",
        len(not_loaded),
        url,
        listed,
    )


def set_aside(
    cat: Catalog, coll: Collective, skip: SkippedCheckpoint, on_event: EventSink | None
) -> None:
    """Quarantine a checkpoint every rank failed to load (the coordinator moves it)."""

    kept_at = coll.on_coordinator(
        f"quarantining {skip.url}", lambda: _quarantine_on_coordinator(cat, skip)
    )
    if kept_at and on_event is not None:
        on_event(
            {
                "event": ev.CKPT_QUARANTINED,
                "step": skip.step,
                "url": skip.url,
                "kept_at": kept_at,
                "path": skip.path,
                "reason": skip.reason,
            }
        )


def _quarantine_on_coordinator(cat: Catalog, skip: SkippedCheckpoint) -> str:
    """Move ``skip`` aside and say so at WARNING; where it is kept ("" when it could not be)."""
    try:
        kept = quarantine_checkpoint(cat.storage, skip.step, skip.reason, skip.path)
    except CheckpointError as exc:  # the fallback goes on; the next resume tries again
        cat.mark(skip.step, CORRUPT, skip.reason)
        logger.error("ckpt: could not quarantine %s: %s", skip.url, exc)
        return ""
    cat.mark(skip.step, QUARANTINED, skip.reason)
    logger.warning(
        "ckpt: quarantined %s (%s); its files are kept at %s, step %d can be saved again "
        "(`python -m ckpt verify %s` checks them, `python -m ckpt gc %s --quarantined` "
        "removes them)",
        skip.url,
        skip.reason,
        kept.url,
        skip.step,
        kept.url,
        cat.storage.root_url,
    )
    return kept.url


def refuse_only_quarantined(coll: Collective, cat: Catalog, root: str) -> None:
    """Collective, for a root without a committed checkpoint: raise if it holds quarantined ones.

    Every checkpoint a run made was set aside as damaged: starting from step 0 would throw
    that run's work away without anyone deciding to (the resume that quarantined them
    raised :class:`~ckpt.errors.NoLoadableCheckpointError`; so does every later one).
    ``cat`` is read on the coordinator only.
    """

    def quarantined_steps() -> list[int]:
        # A damaged commit is what a resume that tried it would have quarantined: the same
        # here, where no committed checkpoint led the resume to try it.
        for info in [info for info in cat if info.status == DAMAGED]:
            skip = SkippedCheckpoint(
                step=info.step, url=info.url, reason=info.reason, path="manifest.json"
            )
            _quarantine_on_coordinator(cat, skip)
        in_place = [info.step for info in cat if info.status in (QUARANTINED, DAMAGED, CORRUPT)]
        return sorted({*in_place, *(q.step for q in cat.quarantined())}, reverse=True)

    aside = coll.on_coordinator(
        f"looking for quarantined checkpoints under {root}", quarantined_steps
    )
    if aside:
        raise NoLoadableCheckpointError(
            f"{root} holds no committed checkpoint, only quarantined ones (steps {aside[:5]}) "
            "that a resume set aside as damaged. Nothing was started from scratch. See why "
            f"with `python -m ckpt ls {root}`; to start from step 0 on purpose, delete them "
            f"first with `python -m ckpt gc --quarantined {root}`.",
            [(step, "quarantined") for step in aside],
        )


def _verified_manifest(cat: Catalog, step: int) -> Manifest | None:
    """Coordinator: the manifest of ``step`` once its files verify; None if not committed.

    A damaged commit (its manifest.json no longer the one COMPLETE vouches for) raises like
    a shard that fails its crc32c: reported, fallen back from and quarantined, never passed
    over in silence as a partial save would be."""
    info = cat.info(step, chunks=True)
    if info.status == DAMAGED:
        raise CorruptCheckpointError(
            f"{info.url}: {info.reason}", url=info.url, path="manifest.json"
        )
    if not info.committed or info.manifest is None:
        logger.debug("ckpt: skipping %s: %s", info.url, info.reason)
        return None
    verify_dir(cat.storage.child(info.dirname), info.manifest).raise_if_bad()
    return info.manifest


def _read_metadata(reader: ShardReader) -> None:
    reader.read_metadata()


def _dcp_load(state: dict[str, Any], reader: ShardReader, coll: Collective) -> None:
    try:
        load_state(state, reader=reader, planner=SafeLoadPlanner(), coll=coll)
    except CheckpointException as exc:
        errors = [err for err, _ in exc.failures.values()]
        for err in errors:
            if isinstance(err, StateMismatchError):
                raise StateMismatchError(str(err)) from None
        # Any failure rejects this checkpoint; damage found in it (a bad crc32c, a missing
        # file) wins over the rest, since only damage sets a checkpoint aside: a storage
        # outage or running out of memory says nothing about its files.
        damage = [e for e in errors if isinstance(e, CorruptCheckpointError)]
        first = next((e for e in damage if e.path), damage[0] if damage else None)
        url = reader.ckpt_dir.root_url
        if first is not None:
            raise CorruptCheckpointError(str(first), url=url, path=first.path) from None
        other = errors[0] if errors else exc
        message = (
            str(other)
            if isinstance(other, CheckpointError)
            else f"{url}: loading failed: {type(other).__name__}: {other}"
        )
        raise CheckpointUnreadableError(message, url=url, path=getattr(other, "path", "")) from None
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointUnreadableError(
            f"{reader.ckpt_dir.root_url}: loading failed on rank {coll.rank}: "
            f"{type(exc).__name__}: {exc}",
            url=reader.ckpt_dir.root_url,
        ) from exc
