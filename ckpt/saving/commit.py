"""Save protocol: shards durable -> DCP metadata -> manifest.json -> COMPLETE.

Called by every rank (collective over the checkpoint group when a process group
is initialized). In order:

1. every rank: report its run id, restart count and host; the job-wide restart
   count is the maximum (torchrun counts restarts per agent);
2. coordinator: refuse to overwrite a committed checkpoint, fence against newer
   attempts, and clear a partial directory left by a dead attempt at this step;
3. every rank: DCP's save protocol (:func:`~ckpt.saving.planning.save_state`, which
   exchanges plans only when the layout changed) through
   :class:`~ckpt.saving.writer.ShardWriter` (each rank's shard file is flushed, fsynced,
   closed and size-checked; the coordinator then writes ``.metadata``);
4. coordinator: gather every rank's files and item checksums, write
   ``manifest.json``, check the fence again, write ``COMPLETE`` last.

Any failure on any rank fails the save on every rank with the same error and
leaves no COMPLETE, so the previous committed checkpoint stays the newest.
"""

from __future__ import annotations

import copy
import datetime
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ckpt import env
from ckpt.dist import Collective
from ckpt.errors import (
    CheckpointDirError,
    CheckpointError,
    CheckpointExistsError,
    FencedError,
    NonFiniteStateError,
    SaveFailedError,
    UnsupportedStateError,
)
from ckpt.format.checksum import crc32c_of
from ckpt.format.layout import (
    ATTEMPT_NAME,
    COMPLETE_NAME,
    MANIFEST_NAME,
    QUARANTINE_MARKER_NAME,
    checkpoint_dirname,
)
from ckpt.format.manifest import Attempt, CompleteMarker, FileEntry, Manifest
from ckpt.root import ownership
from ckpt.root.catalog import PARTIAL, SET_ASIDE, Catalog, inspect_dir
from ckpt.root.quarantine import finish_move as finish_quarantine_move
from ckpt.root.retention import RetentionPolicy, apply_retention, set_aside_renamed
from ckpt.saving import async_save as _async
from ckpt.saving import finite
from ckpt.saving.planning import save_state
from ckpt.saving.session import EventSink, Session, default_session
from ckpt.saving.writer import BlockSavePlanner, ShardWriter
from ckpt.state.state_check import checked_state
from ckpt.storage import Storage, StorageOptions
from runcore import events as ev

logger = logging.getLogger(__name__)

ENV_RUN_ID = env.RUN_ID
ENV_RESTART_COUNT = env.RESTART_COUNT


def utc_now() -> str:
    """Now, UTC, ISO 8601 with milliseconds (the manifests' and markers' timestamps)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def process_start_time() -> float:
    """Unix time at which this process started (Linux /proc; else the first call's time)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()
"""Where /proc cannot tell the process start: when ckpt was imported (a constant)."""


def _local_identity() -> dict[str, Any]:
    run_id, restart_count = env.run_identity()
    return {
        "run_id": run_id,
        "restart_count": restart_count,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started_at": process_start_time(),
    }


def save(
    state: dict[str, Any],
    root: str,
    step: int,
    *,
    metadata: dict[str, Any] | None = None,
    process_group: Any = None,
    on_event: EventSink | None = None,
    storage_options: StorageOptions | None = None,
    retention: RetentionPolicy | None = None,
    async_save: bool = False,
    overlap_staging: Any = None,
    allow_non_finite: bool | Sequence[str] = False,
    root_guard: Callable[[], None] | None = None,
) -> str | _async.PendingSave:
    """Write and commit ``root/checkpoint_{step:07d}/``; return its URL.

    Collective: every rank calls it with its own ``state`` (a dict of state dicts:
    DTensor/FSDP2 shards from ``get_state_dict``, plain tensors, Python scalars).
    ``metadata`` (JSON-serializable; the coordinator's copy is kept) is stored in
    the manifest and returned by :func:`ckpt.load`. With ``retention``, the
    coordinator applies it in a background thread after the commit.

    With ``async_save=True`` it returns a :class:`~ckpt.saving.async_save.PendingSave`
    (``.wait()`` gives the URL) as soon as ``state`` is staged in host memory: the
    caller may change its tensors right away, and the upload and commit run on a
    background thread, whose collectives use only the checkpoint gloo group. At most
    one save is in flight: every save (async or not) first waits for the previous
    one, and raises its error if it failed and nobody saw that error through
    ``PendingSave.wait()``. ``on_event`` is then called from the background thread.
    Call :func:`ckpt.close` (or :func:`ckpt.wait_pending`) before destroying the
    process group or exiting.

    ``overlap_staging`` (an optimizer or a list of them; async saves only) moves the
    staging copy itself to the background thread, so the call returns in
    milliseconds and the copy overlaps the caller's next forward and backward
    passes; a step pre-hook makes each given optimizer's next ``step()`` wait until
    the copy is done (``PendingSave.gate_wait_s`` adds up such waits). The caller
    promises that nothing but those optimizers' ``step()`` changes the state's
    tensors in place until then (``PendingSave.wait_staged()`` waits explicitly).

    Floating tensors are looked at as they are checksummed (:mod:`ckpt.saving.finite`): a
    save holding a NaN or an infinity is not committed
    (:class:`~ckpt.errors.NonFiniteStateError`, naming the tensors), unless
    ``allow_non_finite`` exempts them (``True``, or ``fnmatch`` patterns of the keys,
    e.g. ``["model.*.mask"]`` for a ``-inf`` mask buffer).

    ``root_guard``: called by the coordinator before anything is written and again just
    before COMPLETE; it raises to stop the save (a ``CheckpointManager`` checks there that
    the root is still the one its job owns, :mod:`ckpt.root.lease`).

    Raises :class:`~ckpt.errors.CheckpointExistsError` if the step is already
    committed, :class:`~ckpt.errors.FencedError` if a newer attempt committed,
    :class:`~ckpt.errors.SaveFailedError` (or a storage error) if any rank failed;
    in every case on every rank, and with no COMPLETE written (for an async save:
    at ``wait()``, at the next save, or at ``close()``).
    """
    return save_in(
        default_session(
            process_group=process_group, storage_options=storage_options, on_event=on_event
        ),
        state,
        root,
        step,
        metadata=metadata,
        retention=retention,
        async_save=async_save,
        overlap_staging=overlap_staging,
        allow_non_finite=allow_non_finite,
        root_guard=root_guard,
    )


def save_in(
    session: Session,
    state: dict[str, Any],
    root: str,
    step: int,
    *,
    metadata: dict[str, Any] | None = None,
    retention: RetentionPolicy | None = None,
    async_save: bool = False,
    overlap_staging: Any = None,
    allow_non_finite: bool | Sequence[str] = False,
    root_guard: Callable[[], None] | None = None,
) -> str | _async.PendingSave:
    """:func:`save` in ``session`` (its saver, process group, storage options, events)."""
    if not isinstance(root, str):
        raise TypeError(f"root must be a str URL, got {type(root).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    optimizers = _optimizers(overlap_staging, async_save)
    allow = finite.check_allow(allow_non_finite)
    # Refused before anything is written, on every rank alike: the outcome travels with
    # the protocol's first collective (a rank raising alone would leave its peers waiting).
    try:
        state, state_error = checked_state(state), ""
    except UnsupportedStateError as exc:
        state, state_error = {}, str(exc)
    saver = session.saver
    saver.wait_for_previous(step)
    started = time.monotonic()
    # In the caller's thread: creating the checkpoint group is itself a collective,
    # which must not race with training collectives from a background thread.
    coll = Collective(session.process_group)
    storage = Storage(root, session.storage_options)
    url = storage.child(checkpoint_dirname(step)).root_url
    # An async save's metadata is read later: copy it before the caller can change it.
    meta = copy.deepcopy(metadata) if async_save else metadata

    def run(staged: dict[str, Any], blocking_s: float | None) -> str:
        return _save_staged(
            staged,
            coll=coll,
            storage=storage,
            step=step,
            metadata=meta,
            on_event=session.on_event,
            retention=retention,
            started=started,
            blocking_s=blocking_s,
            saver=saver,
            state_error=state_error,
            allow_non_finite=allow,
            root_guard=root_guard,
        )

    if not async_save:
        return run(state, None)
    return saver.submit(state, run, step=step, url=url, started=started, overlap_with=optimizers)


def _optimizers(overlap_staging: Any, async_save: bool) -> list[torch.optim.Optimizer]:
    if overlap_staging is None:
        return []
    if not async_save:
        raise ValueError("overlap_staging needs async_save=True (a sync save copies nothing)")
    given = overlap_staging if isinstance(overlap_staging, list | tuple) else [overlap_staging]
    for opt in given:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                "overlap_staging takes the torch.optim.Optimizer(s) whose step() changes the "
                f"saved tensors, got {type(opt).__name__}"
            )
    return list(given)


def _save_staged(
    state: dict[str, Any],
    *,
    coll: Collective,
    storage: Storage,
    step: int,
    metadata: dict[str, Any] | None,
    on_event: EventSink | None,
    retention: RetentionPolicy | None,
    started: float,
    blocking_s: float | None,
    saver: _async.AsyncSaver,
    state_error: str = "",
    allow_non_finite: bool | Sequence[str] = False,
    root_guard: Callable[[], None] | None = None,
) -> str:
    """The save protocol (module docstring) on ``state``; on the caller's or the save thread.

    ``state_error``: why this rank's state cannot be saved (:mod:`ckpt.state.state_check`);
    every rank raises it after the first collective, before anything is written.
    """
    storage.faults.rank = coll.rank
    storage.faults.step = step
    dirname = checkpoint_dirname(step)
    ckpt_dir = storage.child(dirname)
    url = ckpt_dir.root_url

    peers = coll.all_gather({**_local_identity(), "state_error": state_error})
    for rank, peer in enumerate(peers):
        if peer.get("state_error"):
            raise UnsupportedStateError(
                f"step {step} was not saved (nothing was written to {url}): rank {rank}: "
                f"{peer['state_error']}"
            )
    attempt = Attempt(
        run_id=str(peers[0]["run_id"]),
        restart_count=max(int(p["restart_count"]) for p in peers),
        save_id=coll.broadcast(uuid.uuid4().hex),
    )
    started_at = min(float(p["started_at"]) for p in peers)

    def prepare() -> None:
        if root_guard is not None:
            root_guard()  # before anything is written under the root
        _prepare(storage, dirname, attempt, started_at)

    coll.on_coordinator(f"preparing {url}", prepare)

    writer = ShardWriter(ckpt_dir)
    writer.save_id = attempt.save_id
    try:
        save_state(state, writer=writer, planner=BlockSavePlanner(), coll=coll)
    except CheckpointException as exc:
        # DCP reports a failed write to every rank only after every rank's write ended.
        if coll.is_coordinator:
            _remove_failed_save(storage, dirname)
        raise SaveFailedError(f"saving step {step} to {url} failed: {_summarize(exc)}") from None
    except CheckpointError:
        raise
    except Exception as exc:  # a peer died mid-collective, a storage error without a wrapper...
        raise SaveFailedError(
            f"saving step {step} to {url} failed on rank {coll.rank}: {type(exc).__name__}: {exc}"
        ) from exc

    local_files = (
        [(r.path, r.size, r.crc32c) for r in writer.records],
        writer.chunks,
        writer.non_finite,
    )
    gathered = coll.all_gather(local_files)
    refusal = _non_finite_refusal(url, step, [nf for _, _, nf in gathered], allow_non_finite)
    if refusal is not None:  # every rank decides the same from what it gathered
        if coll.is_coordinator:
            _remove_failed_save(storage, dirname)
        raise refusal

    def commit() -> int:
        manifest = Manifest(
            step=step,
            created_at=utc_now(),
            world_size=coll.world_size,
            attempt=attempt,
            membership=[
                {"rank": r, "host": p["host"], "pid": p["pid"]} for r, p in enumerate(peers)
            ],
            torch_version=torch.__version__,
            files=sorted(
                (
                    FileEntry(path=p, size=s, crc32c=c)
                    for files, _, _ in gathered
                    for p, s, c in files
                ),
                key=lambda e: e.path,
            ),
            chunks={path: items for _, chunks, _ in gathered for path, items in chunks.items()},
            metadata=dict(metadata or {}),
        )
        manifest_bytes = manifest.to_bytes()
        ckpt_dir.write_bytes(MANIFEST_NAME, manifest_bytes, phase="manifest")
        _check_fence(storage, attempt, step, started_at)
        if root_guard is not None:
            root_guard()  # the root may have been replaced while the shards were written
        marker = CompleteMarker(
            step=step,
            attempt=attempt,
            manifest_crc32c=crc32c_of(manifest_bytes),
            committed_at=utc_now(),
        )
        ckpt_dir.write_bytes(COMPLETE_NAME, marker.to_bytes(), phase="complete")
        ckpt_dir.sync_dir()
        storage.sync_dir()
        _drop_attempt_record(ckpt_dir)
        return manifest.total_bytes

    try:
        total_bytes = coll.on_coordinator(f"committing {url}", commit)
    except FencedError:
        raise  # a newer attempt owns this root now: leave its directories alone
    except CheckpointError:
        if coll.is_coordinator:  # every rank's shard is written: nothing else writes here
            _remove_failed_save(storage, dirname)
        raise
    duration = time.monotonic() - started
    if coll.is_coordinator:
        logger.info(
            "ckpt: committed step %d to %s (%d bytes, %.2f s)", step, url, total_bytes, duration
        )
    if on_event is not None:
        on_event(
            {
                "event": ev.CKPT_SAVED,
                "step": step,
                "url": url,
                "bytes": total_bytes,
                "duration_s": round(duration, 4),
                "blocking_s": round(duration if blocking_s is None else blocking_s, 4),
                "async": blocking_s is not None,
                "world_size": coll.world_size,
                "restart_count": attempt.restart_count,
            }
        )
    if retention is not None and coll.is_coordinator:
        saver.start_housekeeping(
            lambda: _retention_in_background(
                storage, retention, attempt.run_id, saver.said_left_alone
            ),
            name="ckpt-retention",
        )
    return url


def _prepare(storage: Storage, dirname: str, attempt: Attempt, started_at: float) -> None:
    """Coordinator: refuse to overwrite a commit, fence, clear a dead attempt's leftovers,
    and claim the directory for this attempt (``ATTEMPT``, before any shard).

    Lists the root once (a :class:`~ckpt.root.catalog.Catalog` shared with the fence
    check); the step's directory is listed only when the root holds it. Leftovers are
    cleared only when every file in them is one this library writes
    (:mod:`ckpt.root.ownership`); anything else stops the save with an error naming them,
    and a committed checkpoint renamed to this step, or one of this step whose manifest.json
    was damaged after its commit, is quarantined, never deleted.
    """
    catalog = Catalog(storage)
    step = int(dirname.rsplit("_", 1)[-1])
    for entry in catalog.foreign():
        if entry.name == dirname:
            raise CheckpointDirError(
                f"{entry.url} is {entry.reason.split(':', 1)[0]}, where the checkpoint of step "
                f"{step} goes; nothing was written. Move it away to save step {step} here."
            )
    existing = storage.child(dirname).list_files() if catalog.has(step) else {}
    if QUARANTINE_MARKER_NAME in existing and COMPLETE_NAME not in existing:
        # A quarantine interrupted before its move: finish it, never delete the forensics.
        finish_quarantine_move(storage, dirname)
        existing = {}
    if COMPLETE_NAME in existing:
        info = catalog.info(step)
        if info.committed:
            raise CheckpointExistsError(
                f"{info.url} is already committed (by attempt {info.marker.attempt.restart_count} "
                f"of run {info.marker.attempt.run_id!r}); committed checkpoints are never "
                "overwritten. Resume from it, or save under another step or root."
            )
        if info.status in SET_ASIDE:
            if not set_aside_renamed(storage, info):
                raise CheckpointDirError(
                    f"{info.url} could not be set aside ({info.reason}), where the checkpoint "
                    f"of step {step} goes; nothing was deleted or written. Quarantine it with "
                    f"a resume, or move it away, to save step {step} here."
                )
            existing = {}
    _check_fence(storage, attempt, step, started_at, catalog)
    if existing:
        foreign = ownership.strangers(existing)
        if foreign:
            raise CheckpointDirError(
                f"{storage.url(dirname)} holds files this library did not write "
                f"({', '.join(foreign[:5])}), where the checkpoint of step {step} goes; "
                f"nothing was deleted or written. Move them away to save step {step} here."
            )
        owner = ownership.uncommitted_owner(storage, dirname)
        logger.warning(
            "ckpt: removing %d files of an uncommitted save at %s (a dead attempt's leftovers%s)",
            len(existing),
            storage.url(dirname),
            f", run {owner!r}" if owner is not None else "",
        )
        storage.remove_tree(dirname)
    storage.child(dirname).write_bytes(
        ATTEMPT_NAME,
        ownership.attempt_record(
            attempt.run_id, attempt.restart_count, attempt.save_id, socket.gethostname()
        ),
        phase="attempt",
    )


def _non_finite_refusal(
    url: str, step: int, per_rank: list[list[str]], allow: bool | Sequence[str]
) -> NonFiniteStateError | None:
    """The error when a rank wrote a non-finite tensor that ``allow`` does not exempt."""
    found: dict[str, list[int]] = {}
    for rank, keys in enumerate(per_rank):
        for key in finite.refused(keys, allow):
            found.setdefault(key, []).append(rank)
    if not found:
        return None
    return NonFiniteStateError(
        f"step {step} was not committed to {url}: {len(found)} tensor(s) hold NaN or infinite "
        f"values: {finite.describe(found)}. A diverged state never becomes the newest "
        "checkpoint; the newest committed one is unchanged. If these values are meant to be "
        "non-finite (a -inf mask buffer), exempt them with allow_non_finite=[patterns]",
        found,
    )


def _drop_attempt_record(ckpt_dir: Storage) -> None:
    """Remove ``ATTEMPT`` once committed: a committed checkpoint holds exactly the files
    of the layout (COMPLETE and the manifest now say whose it is). Best effort: one left
    behind is harmless (retention and gc know the name)."""
    try:
        ckpt_dir.remove(ATTEMPT_NAME)
    except CheckpointError as exc:
        logger.debug("ckpt: could not remove %s: %s", ckpt_dir.url(ATTEMPT_NAME), exc)


def _check_fence(
    storage: Storage,
    attempt: Attempt,
    step: int,
    started_at: float,
    catalog: Catalog | None = None,
) -> None:
    """Refuse to commit if a newer attempt of this run committed while this one was alive.

    ``catalog``: the listing the save's preparation made; the check before COMPLETE
    passes none and lists afresh (a newer attempt may have committed during the write).

    Restart counts restart at 0 when a job is launched again under the same run id,
    so a higher count alone does not make a commit newer: it must also have been
    made after this attempt's processes started (``started_at``, the earliest
    process start among the ranks).
    """
    latest = (catalog if catalog is not None else Catalog(storage)).latest_committed()
    if latest is None or latest.marker is None:
        return
    newer = latest.marker.attempt
    if newer.run_id != attempt.run_id or newer.restart_count <= attempt.restart_count:
        return
    try:
        committed_at = datetime.datetime.fromisoformat(latest.marker.committed_at).timestamp()
    except ValueError:
        committed_at = None
    if committed_at is not None and committed_at < started_at:
        return  # committed by an earlier launch of the same run id, before we existed
    raise FencedError(
        f"{storage.url()}: step {latest.step} was committed by attempt {newer.restart_count} "
        f"while this writer (attempt {attempt.restart_count}) was running; this process "
        f"belongs to an older attempt and must not commit step {step}"
    )


def _remove_failed_save(storage: Storage, dirname: str) -> None:
    """Coordinator, once every rank gave up on a save: delete its directory, free its space.

    A full disk must not stay full of a save that will never commit (the next save
    of the step would clear it, but the next steps' saves need the space first). A
    directory that is committed, or holds anything this library did not write, is never
    touched. Best effort: a failure here is logged, and the save's own error is what
    the caller sees.
    """
    try:
        files = storage.child(dirname).list_files()
        if COMPLETE_NAME in files and inspect_dir(storage, dirname).status != PARTIAL:
            return  # committed, or a commit whose manifest was damaged: never deleted
        foreign = ownership.strangers(files)
        if foreign:
            logger.warning(
                "ckpt: left %s of the failed save in place: it holds files this library did "
                "not write (%s)",
                storage.url(dirname),
                ", ".join(foreign[:5]),
            )
            return
        storage.remove_tree(dirname)
    except Exception as exc:  # never hide the save's own error behind the cleanup's
        logger.warning(
            "ckpt: could not remove %s of the failed save (%s: %s); the next save of this "
            "step clears it",
            storage.url(dirname), type(exc).__name__, exc,
        )  # fmt: skip
        return
    logger.warning(
        "ckpt: removed %s (%d files) of the failed save, nothing of it was committed",
        storage.url(dirname),
        len(files),
    )


def _summarize(exc: CheckpointException) -> str:
    parts = []
    for rank, (err, _trace) in sorted(exc.failures.items()):
        parts.append(f"rank {rank}: {type(err).__name__}: {err}")
    return "; ".join(parts) or str(exc)


def _retention_in_background(
    storage: Storage, policy: RetentionPolicy, run_id: str, said: set[str]
) -> None:
    try:
        apply_retention(storage, policy, run_id=run_id, said=said)
    except Exception:
        logger.exception("ckpt: retention under %s failed (checkpoints were kept)", storage.url())
