"""``CheckpointManager``: one object that owns a run's checkpoints.

A training script builds one on every rank, right after its model, optimizer(s) and
scheduler(s), and calls it at three places::

    manager = ckpt.CheckpointManager(
        args.ckpt_dir,
        {"model": model, "optim": optimizer, "sched": scheduler, "sampler": sampler},
        every=50, async_save=True,
    )
    start = manager.resume() or 0           # newest committed checkpoint, any world size
    for step in range(start + 1, max_steps + 1):
        ...                                 # forward, backward, optimizer.step()
        manager.maybe_save(step, final=step == max_steps)
    manager.close()

It owns what the module-level ``ckpt.save``/``ckpt.load`` keep in process globals:
the storage root and options, the checkpoint gloo group, the save in flight and its
staging buffers (:class:`~ckpt.async_save.AsyncSaver`), the storage fault registry,
retention, the save policy (every N steps, synchronous at the end, emergency on a
termination signal through ``elastic.RunGuard``) and the event sink.

Every method that touches checkpoints is a collective: every rank calls it, in the
same order. A failed save is logged, reported as a ``checkpoint_failed`` event and
training goes on (the previous committed checkpoint stays the newest).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem

from ckpt import async_save as _async
from ckpt import dist as _dist
from ckpt import per_rank
from ckpt import root_check as _root_check
from ckpt.app_state import AppState, shape_mismatch
from ckpt.capture import MANAGER_META_KEY, Captured, StateCapture
from ckpt.commit import save as _save
from ckpt.discovery import Catalog
from ckpt.errors import (
    CheckpointDirError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointShapeError,
    SaveFailedError,
    StorageError,
    TooManySaveFailuresError,
)
from ckpt.faults import FaultRegistry, parse_storage_faults
from ckpt.memory_tier import MemoryTier, SnapshotError
from ckpt.restore import LoadResult, refuse_only_quarantined
from ckpt.retention import DEFAULT_RETENTION, RetentionPolicy
from ckpt.retention import describe as describe_retention
from ckpt.rng import (
    RNG_STATE_KEY,
    capture_rng,
    reseed_process,
    restore_rng,
    rng_device,
    rng_key,
)
from ckpt.storage import Storage, StorageOptions
from ckpt.tiers import Candidate, DurableHead, DurableTier, MemorySnapshots, Tier, manager_record
from runcore import events as ev

logger = logging.getLogger(__name__)

EventCallback = Callable[..., None]
"""``on_event(name, step, **fields)``: the signature of a run recorder's ``event``."""

ESTIMATE_BYTES_PER_S = 50e6
"""Before any save was timed, an emergency save is assumed to write this fast..."""
ESTIMATE_FIXED_S = 2.0
"""...plus this much for the protocol's collectives and the commit."""


@dataclass(frozen=True, slots=True)
class ResumeInfo:
    """What :meth:`CheckpointManager.resume` restored."""

    step: int
    url: str
    old_world_size: int
    new_world_size: int
    rng_restored: bool
    bytes_read: int
    duration_s: float
    metadata: dict[str, Any]
    """The user metadata saved with the checkpoint (``metadata=`` at save time)."""
    tier: str = "durable"
    """``"durable"`` (the root) or ``"memory"`` (a memory-tier snapshot, ``memory_every``)."""


class CheckpointManager:
    """Saves and resumes one run's state under one root; every rank holds one.

    ``state`` maps names to the objects to checkpoint (see :mod:`ckpt.app_state`):
    models, optimizers, LR schedulers and other ``Stateful`` objects, plain values.
    Plain values are put back into the same dict by :meth:`resume`.

    ``every``: :meth:`maybe_save` saves every N steps (0: only at ``final``).
    ``async_save``: periodic saves return once the state is staged (the copy itself
    overlaps the next forward/backward and the optimizers' next ``step()`` waits for
    it); the final and emergency saves are synchronous. ``rng``: save each rank's RNG
    under its own key; on resume it is restored when the world size is unchanged and
    re-derived from ``(seed, step, rank)`` otherwise. ``metadata``: a dict, or a function
    of the step returning one, stored in the manifest and returned by :meth:`resume`
    (``ResumeInfo.metadata``). ``on_event(name, step, **fields)`` receives
    ``checkpoint_saved``, ``checkpoint_loaded``, ``fallback``, ``checkpoint_failed`` and
    ``resume`` events (from the save thread too: it must be thread-safe).

    Memory tier (opt-in): ``memory_every=K`` (0: off, the default) also snapshots the
    state every K steps into node-local memory that outlives the process (files under
    ``memory_dir``, else ``CKPT_MEMORY_DIR``, else ``/dev/shm/ckpt-memory``), and a
    background thread copies each rank's shard to a rank on another node (hostname +
    memory dir; none when every rank shares one node). The snapshot is committed when
    :meth:`maybe_save` returns (the rank's shard written, one all_gather, a COMPLETE-like
    commit record on every node), so a killed worker resumes from it.
    :meth:`resume` takes the newest snapshot that is complete across the surviving
    nodes, newer than the newest durable checkpoint and not from an attempt older than
    it, verifies every copy's crc32c, ships missing shards from peers and loads it like a
    durable checkpoint (resharding included); if it fails it falls back to the next
    snapshot, then to the durable tier, and emits ``tier_choice`` (tier, step, why).
    Snapshots are never a durable commit: :meth:`save`, ``final`` and emergency saves go
    to ``root`` as before. Host memory per rank: two snapshots of its shard plus two of
    the replica it holds. A failed snapshot emits ``memory_snapshot_failed``.

    Retention: ``retention`` (default :data:`~ckpt.retention.DEFAULT_RETENTION`, keep
    the newest 3; ``None`` keeps everything) is applied by the coordinator after every
    commit, never to the checkpoint this run resumed from before a newer commit, to a
    partial directory newer than the newest commit (a save in flight) or to a
    quarantined one; the policy is said at WARNING on rank 0 when the manager is built.

    Failed saves: ``max_failures`` (default 3; 0: never stop) durable saves failing in a
    row make :meth:`maybe_save` raise :class:`~ckpt.errors.TooManySaveFailuresError` on
    every rank at the same step, and a failed ``final`` save raises it at once: a job
    must not train on, or exit 0, without a checkpoint. A commit resets the count.

    Construct it on every rank at the same point: with a process group it creates the
    checkpoint gloo group, which is a collective.
    """

    def __init__(
        self,
        root: str,
        state: dict[str, Any],
        *,
        every: int = 0,
        async_save: bool = False,
        rng: bool = True,
        seed: int = 0,
        metadata: dict[str, Any] | Callable[[int], dict[str, Any]] | None = None,
        retention: RetentionPolicy | None = DEFAULT_RETENTION,
        on_event: EventCallback | None = None,
        storage_options: StorageOptions | None = None,
        process_group: Any = None,
        memory_every: int = 0,
        memory_dir: str | None = None,
        max_failures: int = 3,
    ) -> None:
        if not isinstance(root, str) or not root:
            raise ValueError(f"root must be a non-empty str URL or path, got {root!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"every must be an int >= 0 (0: save only at the end), got {every!r}")
        if isinstance(memory_every, bool) or not isinstance(memory_every, int) or memory_every < 0:
            raise ValueError(
                f"memory_every must be an int >= 0 (0: no memory tier), got {memory_every!r}"
            )
        if isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < 0:
            raise ValueError(
                f"max_failures must be an int >= 0 (0: never stop for failed saves), "
                f"got {max_failures!r}"
            )
        self.root = root
        self.app = AppState.classify(state)
        self.every = every
        self.async_save = async_save
        self.rng = rng
        self.seed = seed
        self.retention = retention
        self._on_event = on_event
        self.faults = FaultRegistry(read_env=True)
        """Storage faults for this manager's saves and loads (``inject_storage_fault``, and
        ``CKPT_STORAGE_FAULTS`` read at the first storage call)."""
        base = storage_options if storage_options is not None else StorageOptions.from_env()
        self.storage_options = _with_faults(base, self.faults)
        self._async = _async.AsyncSaver()
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = _dist.new_checkpoint_group()
        self._group = process_group
        coll = _dist.Collective(process_group)
        self.rank, self.world_size = coll.rank, coll.world_size
        self.memory_every = memory_every
        self._memory = (
            MemoryTier(
                root,
                memory_every,
                memory_dir=memory_dir,
                distributed=dist.is_available() and dist.is_initialized(),
            )
            if memory_every
            else None
        )
        self.last_save_s: float | None = None
        """Wall seconds of the last save that finished, sync or async (staging + persist)."""
        self.last_committed_step: int | None = None
        """Step of the newest checkpoint this manager committed or resumed from."""
        self.last_resume: ResumeInfo | None = None
        self._saves_in_flight: dict[int, dict[str, Any]] = {}
        self._state = StateCapture(
            self.app,
            rank=self.rank,
            world_size=self.world_size,
            rng=rng,
            metadata=metadata,
            group=process_group,
        )
        self.max_failures = max_failures
        if self.rank == 0:
            logger.warning("rank 0: checkpoints under %s: %s", root, describe_retention(retention))
        self.consecutive_failures = 0
        """Durable saves that failed since the last commit (emergency saves included)."""
        self._last_failure = ""
        self._closed = False

    # -- events --------------------------------------------------------------------------

    def _emit(self, name: str, step: int, **fields: Any) -> None:
        if self._on_event is not None:
            self._on_event(name, step, **fields)

    def _sink(self, **extra: Any) -> Callable[[dict[str, Any]], None]:
        def sink(event: dict[str, Any]) -> None:
            fields = dict(event)
            raw = str(fields.pop("event", "ckpt_event"))
            step = int(fields.pop("step", 0) or 0)
            self._emit(ev.RUN_LOG_NAME.get(raw, raw), step, **fields, **extra)

        return sink

    # -- root ----------------------------------------------------------------------------

    def check_root(self) -> None:
        """Fail early, on every rank together, when the root cannot be used (collective).

        First the coordinator refuses a root that is, or is inside, a checkpoint
        (nothing is created there; :func:`~ckpt.root_check.refuse_checkpoint_as_root`).
        Then a local root is created, any root is listed (bounded by the storage
        timeouts) and a probe object is written, read back and deleted (by every rank
        for a local root, which may be a per-node disk; by the coordinator for an
        object store), so a bad scheme, a path under a file, a read-only or full disk,
        missing permissions or a missing bucket raise
        :class:`~ckpt.errors.CheckpointDirError` here, before any training.
        """
        coll = _dist.Collective(self._group)

        def refuse() -> None:
            try:
                storage = Storage(self.root, self.storage_options)
                entries = storage.list_dir()
            except Exception:  # unreachable: reported by check() below, with its cause
                return
            _root_check.refuse_checkpoint_as_root(storage, entries)

        coll.on_coordinator(f"checking that {self.root} is not a checkpoint", refuse)

        def check() -> None:
            try:
                storage = Storage(self.root, self.storage_options)
                local = isinstance(storage.fs, LocalFileSystem)
                if local:
                    storage.fs.makedirs(storage.path(), exist_ok=True)
                storage.list_dir()
                storage.check_reachable()  # a missing bucket lists as empty
                if local or coll.is_coordinator:
                    _root_check.probe_writable(storage)
            except Exception as exc:  # any failure means the root is unusable
                raise CheckpointDirError(
                    f"checkpoint root {self.root!r} is not reachable or writable: "
                    f"{type(exc).__name__}: {exc} [fix the path/URL, the permissions or "
                    "credentials, or free space]"
                ) from exc

        coll.on_every_rank(f"checking {self.root}", check)

    # -- resume --------------------------------------------------------------------------

    def resume(self, *, must: bool = False) -> int | None:
        """Load the newest committed checkpoint that verifies; return its step, or None.

        Collective. Checks the root first (:meth:`check_root`). Returns None, touching
        nothing, when the root holds no committed checkpoint (said at WARNING on rank 0:
        a typo in the root must not pass for a fresh run); with ``must=True`` that is a
        :class:`~ckpt.errors.CheckpointNotFoundError` instead. Models and optimizers
        reshard to this world size; a checkpoint that fails verification is reported
        (``fallback`` event) and the previous one is used. Raises
        :class:`~ckpt.errors.CheckpointShapeError` for a checkpoint of other shapes and
        :class:`~ckpt.errors.NoLoadableCheckpointError` when none loads, or when the root
        holds only quarantined ones (never a fresh start over damaged work).

        One path for every tier (:mod:`ckpt.tiers`): the memory tier's snapshots newer
        than the durable head first (when it is on), then the durable root.
        """
        self.check_root()
        coll = _dist.Collective(self._group)
        # One listing of the root for the whole resume (the coordinator's; load reuses it).
        catalog = Catalog(Storage(self.root, self.storage_options))

        def newest() -> DurableHead | None:
            info = catalog.latest_committed()
            if info is None or info.manifest is None:
                return None
            attempt = info.manifest.attempt
            return DurableHead(
                info.step,
                info.manifest.world_size,
                manager_record(info.manifest.metadata),
                attempt.run_id,
                attempt.restart_count,
            )

        head = coll.on_coordinator(f"finding the newest checkpoint under {self.root}", newest)
        notes: list[str] = []
        for tier in self._tiers(catalog):
            for cand in tier.candidates(head, notes):
                loaded = self._resume_from(tier, cand, head, notes, must)
                if loaded is not None:
                    return None if loaded < 0 else loaded
            tier.exhausted()
        self._tier_choice("none", 0, head, notes)
        refuse_only_quarantined(coll, catalog, self.root)  # damaged work is no fresh start
        return self._nothing_to_resume(must)

    def _tiers(self, catalog: Catalog) -> list[Tier]:
        common = {"group": self._group, "sink": self._sink, "saver": self._async}
        durable = DurableTier(
            self.root,
            catalog=catalog,
            storage_options=self.storage_options,
            rank=self.rank,
            **common,
        )
        if self._memory is None:
            return [durable]
        return [MemorySnapshots(self._memory, rank=self.rank, **common), durable]

    def _resume_from(
        self,
        tier: Tier,
        cand: Candidate,
        head: DurableHead | None,
        notes: list[str],
        must: bool,
    ) -> int | None:
        """Resume from one candidate: its step; None to try the next; -1 for "nothing"."""
        problem = shape_mismatch(self.app.tensor_shapes(), cand.record.get("shapes", {}))
        if problem is not None:
            if tier.strict:
                raise CheckpointShapeError(
                    f"checkpoint {self.root} (step {cand.step}) was written for a different "
                    f"model: {problem}; load it with the model it was saved from, or use "
                    "another root"
                )
            notes.append(
                f"{tier.name} step {cand.step} was written for a different model: {problem}"
            )
            return None
        started = time.monotonic()
        fresh = [k for k in cand.record.get("fresh_optimizers", []) if k in self.app.optimizers]
        want_rng = (
            self.rng
            and (tier.strict or bool(cand.record.get("rng", True)))
            and cand.world_size == self.world_size
        )
        try:
            layout = self._state.per_rank_layout(cand.record, cand.world_size)
            template = self.app.state_dict(skip_optimizers=fresh)
            per_rank.move_out(template, *layout)
            if want_rng:
                template[RNG_STATE_KEY] = {rng_key(self.rank): capture_rng(rng_device())}
            result, rng_loaded = tier.load(cand, template, want_rng, notes)
        except CheckpointError as exc:
            if tier.strict:
                raise
            notes.append(f"{tier.name} step {cand.step} rejected: {exc}")
            if self.rank == 0:
                logger.error(
                    "%s snapshot of step %d rejected, trying the next tier: %s",
                    tier.name, cand.step, exc,
                )  # fmt: skip
            url = self._memory.url(cand.step) if self._memory is not None else self.root
            self._emit(
                ev.FALLBACK,
                cand.step,
                tier=tier.name,
                url=url,
                path=getattr(exc, "path", ""),
                reason=str(exc),
            )
            return None
        if result is None:  # every committed checkpoint vanished between listing and loading
            self._nothing_to_resume(must)
            return -1
        per_rank.move_back(template, *layout)
        loaded = self._finish_resume(result, template, rng_loaded, fresh, started, tier)
        tier.resumed(cand)
        if tier.strict:
            self.last_committed_step = loaded
        else:
            self.last_committed_step = head.step if head is not None else None
        timings = getattr(tier, "timings", None)
        self._tier_choice(tier.name, loaded, head, notes, timings)
        return loaded

    def _nothing_to_resume(self, must: bool) -> None:
        """A resume that found no committed checkpoint: an error with ``must``, else said."""
        if must:
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {self.root} and resume is required "
                "(must=True / --resume must); check the root, or resume only if one exists"
            )
        if self.rank == 0:
            logger.warning(
                "rank 0: no committed checkpoint under %s: starting from step 0", self.root
            )

    def _tier_choice(
        self,
        tier: str,
        step: int,
        head: DurableHead | None,
        notes: list[str],
        timings: dict[str, float] | None = None,
    ) -> None:
        """The ``tier_choice`` event of a resume with the memory tier on: which tier and why."""
        if self._memory is None:
            return
        durable = None if head is None else head.step
        against = f"durable {durable}" if durable is not None else "no durable checkpoint"
        if tier == "memory":
            why = f"memory step {step} newer than {against}"
        elif tier == "durable":
            why = f"durable step {step}: no usable memory snapshot newer than it"
        else:
            why = "nothing to resume from: no usable memory snapshot, no durable checkpoint"
        if notes:
            why += " (" + "; ".join(notes) + ")"
        if self.rank == 0:
            logger.info("rank 0: resume tier: %s", why)
        extra = {"timings": {k: round(v, 4) for k, v in timings.items()}} if timings else {}
        self._emit(ev.TIER_CHOICE, step, tier=tier, reason=why, durable_step=durable, **extra)

    def _finish_resume(
        self,
        result: LoadResult,
        template: dict[str, Any],
        rng_loaded: bool,
        fresh: list[str],
        started: float,
        tier: Tier,
    ) -> int:
        """Push a loaded checkpoint into the objects, set RNG, record and report the resume."""
        self.app.load(template, skip_optimizers=fresh)
        # Never prune what we resumed from before this run commits a newer checkpoint.
        if tier.strict and self.retention is not None:
            self.retention = dataclasses.replace(
                self.retention, protect=frozenset({int(result.step)})
            )
        self._state.mark_resumed(int(result.step))
        old_world = int(result.manifest.world_size)
        loaded_step = int(result.step)
        rng_restored = rng_loaded and old_world == self.world_size
        if rng_restored:
            restore_rng(template[RNG_STATE_KEY][rng_key(self.rank)], rng_device())
        elif self.rng:
            reseed_process(self.seed, loaded_step, self.rank)
        user_meta = {k: v for k, v in result.metadata.items() if k != MANAGER_META_KEY}
        url = tier.url(result)
        self.last_resume = ResumeInfo(
            step=loaded_step,
            url=url,
            old_world_size=old_world,
            new_world_size=self.world_size,
            rng_restored=rng_restored,
            bytes_read=int(result.bytes_read),
            duration_s=time.monotonic() - started,
            metadata=user_meta,
            tier=tier.name,
        )
        if self.rank == 0:
            logger.warning(
                "rank 0: resumed step %d from %s (%s tier, world size %d -> %d, RNG %s, %.2f s)",
                loaded_step, url, tier.name, old_world, self.world_size,
                "restored" if rng_restored else "re-derived", self.last_resume.duration_s,
            )  # fmt: skip
        extra = {"tier": tier.name} if self._memory is not None else {}
        self._emit(
            ev.RESUME,
            loaded_step,
            url=url,
            old_world_size=old_world,
            new_world_size=self.world_size,
            rng_restored=rng_restored,
            bytes=int(result.bytes_read),
            duration_s=round(self.last_resume.duration_s, 4),
            **extra,
        )
        return loaded_step

    # -- save ----------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether :meth:`maybe_save` saves at ``step`` (every ``every`` steps)."""
        return bool(self.every) and step % self.every == 0

    def maybe_save(self, step: int, *, final: bool = False) -> str | None:
        """Save when ``step`` is due (every ``every`` steps) or ``final``; else do nothing.

        Periodic saves are asynchronous with ``async_save``; a ``final`` save is
        synchronous, so the run ends on a commit. Returns the checkpoint URL (for an
        async save: where it will be committed), or None when nothing was saved or the
        save failed (logged, ``checkpoint_failed`` event; training goes on).

        With ``memory_every``, every K-th step (not ``final``) first takes a memory-tier
        snapshot, committed on every rank's node when this returns (a failure is logged
        and reported as ``memory_snapshot_failed``; training goes on).
        """
        captured = None
        if self._memory is not None and not final and self._memory.due(step):
            captured = self._state.capture(step, reuse_shapes=True)
            self._snapshot(step, captured)
        if not (final or self.due(step)):
            return None
        url = self._save(step, blocking=final or not self.async_save, captured=captured)
        self._stop_if_failing(step)
        if final and url is None:
            raise TooManySaveFailuresError(
                f"rank {self.rank}: the final checkpoint at step {step} under {self.root} failed "
                f"({self._last_failure}); the run did not end on a commit. Fix the storage and "
                "run again: it resumes from the newest committed checkpoint"
            )
        return url

    def _snapshot(self, step: int, captured: Captured) -> None:
        """Memory-tier snapshot of ``step`` (collective); a failure is reported, never raised."""
        tier = self._memory
        assert tier is not None
        for error in tier.replication_errors():
            self._emit(
                ev.MEMORY_SNAPSHOT_FAILED, step, phase="replicate", error=error, rank=self.rank
            )
        state, meta, _ = captured
        try:
            tier.snapshot(step, state, meta)
        except SnapshotError as exc:
            logger.error("rank %d step %d: %s; training continues", self.rank, step, exc)
            self._emit(
                ev.MEMORY_SNAPSHOT_FAILED, step, phase="write", error=str(exc), rank=self.rank
            )

    def save(self, step: int, *, blocking: bool = True, emergency: bool = False) -> str | None:
        """Save ``step`` now (collective); returns the URL, or None when the save failed.

        ``blocking=False`` returns once the state is staged (async). A step already
        committed by this manager is not saved again. A background save that failed is
        reported (event) before this one starts. Raises
        :class:`~ckpt.errors.TooManySaveFailuresError` (not for ``emergency``) once
        ``max_failures`` saves failed in a row.
        """
        url = self._save(step, blocking=blocking, emergency=emergency)
        if not emergency:
            self._stop_if_failing(step)
        return url

    def _save(
        self,
        step: int,
        *,
        blocking: bool,
        emergency: bool = False,
        captured: Captured | None = None,
    ) -> str | None:
        self._collect_previous()
        if self.last_committed_step == step:
            return self._url(step)
        if not emergency and self._failing():
            return None  # the caller stops the job: no new save to wait for
        started = time.monotonic()
        state, meta, fresh = captured if captured is not None else self._state.capture(step)
        self._state.detect_per_rank(state, meta)
        extra = {"emergency": True} if emergency else {}
        background = not blocking
        try:
            result = _save(
                state,
                self.root,
                step,
                metadata=meta,
                process_group=self._group,
                on_event=self._sink(**extra),
                storage_options=self.storage_options,
                retention=self.retention,
                async_save=background,
                overlap_staging=self._overlap(fresh) if background else None,
                _saver=self._async,
            )
        except (SaveFailedError, StorageError) as exc:
            self._report_failure(step, exc, emergency=emergency)
            return None
        if background:
            assert isinstance(result, _async.PendingSave)
            self._saves_in_flight[step] = extra
            if self.rank == 0:
                logger.info(
                    "rank 0 step %d: checkpoint staged in %.3f s, committing in the background to %s",
                    step,
                    time.monotonic() - started,
                    result.url,
                )
            return result.url
        assert isinstance(result, str)
        self.last_save_s = time.monotonic() - started
        self.last_committed_step = step
        self.consecutive_failures = 0
        self._release_protection()
        if self.rank == 0:
            logger.info("rank 0 step %d: checkpoint committed at %s", step, result)
        return result

    def _overlap(self, fresh: list[str]) -> list[torch.optim.Optimizer] | None:
        # The staging copy overlaps the next forward/backward; each optimizer's next
        # step() waits for it. Only when optimizers are the only in-place writers of
        # the saved tensors, which is what a training loop between two saves does.
        optimizers = [opt for key, (opt, _) in self.app.optimizers.items() if key not in fresh]
        return optimizers or None

    def _url(self, step: int) -> str:
        from ckpt.layout import checkpoint_dirname

        return Storage(self.root, self.storage_options).url(checkpoint_dirname(step))

    def _collect_previous(self, timeout: float | None = None) -> None:
        """Wait for the background save in flight; record its outcome (all ranks)."""
        pending = self._async.pending
        if pending is None or pending.step not in self._saves_in_flight:
            return
        self._saves_in_flight.pop(pending.step)
        try:
            self._async.wait_pending(timeout)
        except (SaveFailedError, StorageError) as exc:
            self._report_failure(pending.step, exc)
            return
        self.last_save_s = pending.duration_s
        self.last_committed_step = pending.step
        self.consecutive_failures = 0
        self._release_protection()

    def _report_failure(self, step: int, exc: CheckpointError, *, emergency: bool = False) -> None:
        """Count, log and report a failed save (every rank: saves fail on every rank at once)."""
        self.consecutive_failures += 1
        self._last_failure = f"step {step}: {exc}"
        failures = f"{self.consecutive_failures} in a row"
        if self.max_failures:
            failures += f", the job stops at {self.max_failures}"
        if emergency:
            logger.error(
                "rank %d: emergency checkpoint at step %d FAILED (%s): %s; a relaunch resumes "
                "from the newest committed checkpoint",
                self.rank, step, failures, exc,
            )  # fmt: skip
        else:
            logger.error(
                "rank %d step %d: checkpoint save failed (%s): %s",
                self.rank, step, failures, exc,
            )  # fmt: skip
        self._emit(
            ev.CHECKPOINT_FAILED,
            step,
            error=str(exc),
            rank=self.rank,
            consecutive=self.consecutive_failures,
            **({"emergency": True} if emergency else {}),
        )

    def _release_protection(self) -> None:
        """A newer commit exists: the checkpoint resumed from ages out like any other."""
        if self.retention is not None and self.retention.protect:
            self.retention = dataclasses.replace(self.retention, protect=frozenset())

    def _failing(self) -> bool:
        return bool(self.max_failures) and self.consecutive_failures >= self.max_failures

    def _stop_if_failing(self, step: int) -> None:
        """Raise on every rank together once ``max_failures`` saves in a row failed.

        The count moves in lockstep on every rank: a save's outcome (and an async
        save's, collected at the next save) is the same everywhere.
        """
        if not self._failing():
            return
        last = "none" if self.last_committed_step is None else f"step {self.last_committed_step}"
        raise TooManySaveFailuresError(
            f"rank {self.rank} step {step}: {self.consecutive_failures} checkpoint saves in a row "
            f"failed under {self.root} (max_failures={self.max_failures}); the last one, "
            f"{self._last_failure}. Stopping instead of training on without checkpoints "
            f"(newest committed: {last}). Fix the storage and relaunch; it resumes from there"
        )

    def wait(self, timeout: float | None = None) -> str | None:
        """Wait for a background save (all ranks); return the newest committed URL or None."""
        self._collect_previous(timeout)
        return None if self.last_committed_step is None else self._url(self.last_committed_step)

    # -- emergency saves (the saver protocol of ``elastic.RunGuard``) ----------------------

    def expected_save_s(self) -> float:
        """Seconds a synchronous save of this state is expected to take on this rank.

        The duration of the last save that finished (async included: staging and
        persist), else an estimate from the bytes this rank holds.
        """
        if self.last_save_s is not None:
            return self.last_save_s
        return ESTIMATE_FIXED_S + self.app.local_bytes() / ESTIMATE_BYTES_PER_S

    def emergency_save(self, step: int) -> bool:
        """Commit ``step`` synchronously after a termination signal (collective).

        Waits for a background save first; returns True when ``step`` is committed.
        """
        self._collect_previous()
        if self.last_committed_step == step:
            return True
        return self.save(step, blocking=True, emergency=True) is not None

    def inject_storage_fault(self, spec: str) -> None:
        """Arm storage faults (``ckpt-storage:phase=..:error=..`` or ``PHASE:KIND``) for
        this manager's next storage calls; the fault grammar of ``elastic.FaultPlan``."""
        self.faults.install(*parse_storage_faults(spec))

    # -- lifetime ------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Wait for a background save and free the staging buffers (all ranks).

        Call before ``destroy_process_group``. A failed background save is reported as an
        event and logged; close itself does not raise for it.
        """
        if self._closed:
            return
        try:
            self._collect_previous(timeout)
            self._async.close(timeout)
        except CheckpointError as exc:
            logger.error("rank %d: background checkpoint save failed: %s", self.rank, exc)
        finally:
            self._closed = True
            self._group = None
            if self._memory is not None:
                self._memory.close(self.last_committed_step)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _with_faults(options: StorageOptions, registry: FaultRegistry) -> StorageOptions:
    return dataclasses.replace(options, faults=registry)
