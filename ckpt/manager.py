"""``CheckpointManager``: one object that owns a run's checkpoints (usage: :mod:`ckpt`).

The manager holds an ordered list of tiers (:mod:`ckpt.tiers`; by default the memory
tier when it is on, then the durable root) and knows none of them by name: it offers
each step to every tier whose save-decision policy says it is due
(:mod:`ckpt.saving.policy`), a resume walks the tiers' candidates in order
(:mod:`ckpt.tiers.resume`), and :meth:`~CheckpointManager.close` closes them. Every
method that touches checkpoints is a collective: every rank calls it, in the same order.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from ckpt import dist as _dist
from ckpt import env as _env
from ckpt.errors import CheckpointError
from ckpt.loading import fresh_start
from ckpt.notices import LoopNotices, say_start
from ckpt.options import CheckpointOptions, option_view
from ckpt.root import root_check as _root_check
from ckpt.root.catalog import Catalog
from ckpt.root.lease import JobIdentity, RootLease, take_lease
from ckpt.root.retention import RetentionPolicy
from ckpt.root.retention import describe as describe_retention
from ckpt.saving.decisions import SaveDecisions
from ckpt.saving.saves import DurableSaves, SaveFailures, expected_save_s
from ckpt.state.app_state import AppState
from ckpt.state.capture import StateCapture
from ckpt.storage import Storage, StorageOptions
from ckpt.storage.faults import FaultRegistry, parse_storage_faults
from ckpt.tiers import SaveRequest, Tier, TierBuilder, TierContext, build_tiers
from ckpt.tiers.defaults import DEFAULT_TIERS
from ckpt.tiers.resume import ResumeInfo, ResumeWalk, earlier_attempts
from runcore import events as ev
from runcore.redact import redact_fields

__all__ = ["CheckpointManager", "EventCallback", "ResumeInfo"]

logger = logging.getLogger(__name__)

EventCallback = Callable[..., None]
"""``on_event(name, step, **fields)``: the signature of a run recorder's ``event``."""


class CheckpointManager:
    """Saves and resumes one run's state under one root; every rank holds one.

    ``state`` maps names to the objects to checkpoint (:mod:`ckpt.state.app_state`):
    models, optimizers, LR schedulers and other ``Stateful`` objects, plain values (put
    back into the same dict by :meth:`resume`). An optimizer stepped by a scheduler that
    is not in ``state`` is said at WARNING here (its schedule would restart at a resume).

    ``options``: a :class:`~ckpt.options.CheckpointOptions` (save policy, async saves,
    retention, failure stop, memory tier, optimizer settings, non-finite values, the
    root's lease: each field documented there, the behaviour in docs/ckpt.md); or the
    same settings as keyword arguments (``every=50, async_save=True``, ``retention=`` a
    :class:`~ckpt.root.retention.RetentionPolicy` or None), not both.

    ``rng``: save each rank's RNG under its own key; a resume restores it when the world
    size is unchanged and re-derives it from ``(seed, step, rank)`` otherwise.
    ``metadata``: a dict, or a function of the step returning one, stored in the manifest
    and returned by :meth:`resume` (``ResumeInfo.metadata``). ``on_event(name, step,
    **fields)`` receives ``checkpoint_saved``, ``checkpoint_loaded``, ``fallback``,
    ``checkpoint_failed`` and ``resume`` events (from the save thread too: thread-safe).
    ``tiers``: the :data:`~ckpt.tiers.TierBuilder` functions, in order (None:
    :data:`~ckpt.tiers.defaults.DEFAULT_TIERS`); exactly one strict tier, the durable
    root, last.

    Construct it on every rank at the same point: with a process group it creates the
    checkpoint gloo group, a collective; ``setup_timeout_s`` bounds the wait there.
    """

    def __init__(
        self,
        root: str,
        state: dict[str, Any],
        *,
        options: CheckpointOptions | None = None,
        rng: bool = True,
        seed: int = 0,
        metadata: dict[str, Any] | Callable[[int], dict[str, Any]] | None = None,
        on_event: EventCallback | None = None,
        storage_options: StorageOptions | None = None,
        process_group: Any = None,
        tiers: Sequence[TierBuilder] | None = None,
        **option_kwargs: Any,
    ) -> None:
        if not isinstance(root, str) or not root:
            raise ValueError(f"root must be a non-empty str URL or path, got {root!r}")
        options = CheckpointOptions.resolve(options, option_kwargs)
        _env.validate()  # every CKPT_* variable now, not at the first save
        ttl = _env.lease_ttl_s() if options.lease_ttl_s is None else float(options.lease_ttl_s)
        self.root = root
        self.options = options
        """Every setting of this manager (:class:`~ckpt.options.CheckpointOptions`)."""
        self.app = AppState.classify(state)
        self.rng = rng
        self.seed = seed
        self._on_event = on_event
        self.faults = FaultRegistry(read_env=True)
        """Storage faults for this manager's saves and loads (``inject_storage_fault``, and
        ``CKPT_STORAGE_FAULTS`` read now)."""
        base = storage_options if storage_options is not None else StorageOptions.from_env()
        self.storage_options = dataclasses.replace(base, faults=self.faults)
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = _dist.new_checkpoint_group(setup_timeout_s=options.setup_timeout_s)
        self._group = process_group
        coll = _dist.Collective(process_group)
        self.rank, self.world_size = coll.rank, coll.world_size
        self.last_resume: ResumeInfo | None = None
        self._leased = ttl > 0
        self.lease = (
            RootLease(Storage(root, self.storage_options), JobIdentity.from_env(), ttl)
            if self._leased and self.rank == 0
            else None
        )
        """The root's owner lease (the coordinator's; None on other ranks or with no lease)."""
        self._state = StateCapture(
            self.app,
            rank=self.rank,
            world_size=self.world_size,
            rng=rng,
            metadata=metadata,
            group=process_group,
        )
        retention = options.retention()
        self._saves = DurableSaves(
            root,
            app=self.app,
            capture=self._state,
            storage_options=self.storage_options,
            group=process_group,
            retention=retention,
            failures=SaveFailures(options.max_failures, rank=self.rank, root=root, emit=self._emit),
            sink=self._sink,
            rank=self.rank,
            allow_non_finite=options.allow_non_finite,
            root_guard=self.lease.check if self.lease is not None else None,
        )
        context = TierContext(options=options, saves=self._saves, emit=self._emit)
        self._tiers = build_tiers(DEFAULT_TIERS if tiers is None else tiers, context)
        self._durable = self._tiers[-1]
        if self.rank == 0:
            schedulers = self.app.unsaved_schedulers()
            say_start(root, options, describe_retention(retention), schedulers)
        self._closed = False
        self._loop = LoopNotices(self.rank)
        self._decisions = SaveDecisions(process_group)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """This manager's tiers, in the order saves and resumes visit them (durable last)."""
        return tuple(self._tiers)

    def tier(self, name: str) -> Tier | None:
        """The tier called ``name`` (``"memory"``, ``"durable"``), or None when it is off."""
        return next((tier for tier in self._tiers if tier.name == name), None)

    # -- events --------------------------------------------------------------------------

    def _emit(self, name: str, step: int, **fields: Any) -> None:
        if self._on_event is not None:
            self._on_event(name, step, **redact_fields(fields))

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

        A root that is, or is inside, a checkpoint is refused (nothing is created
        there); a local root is created; the root is listed and a probe object written,
        read back and deleted (:func:`~ckpt.root.root_check.check_root`), so a bad scheme, a
        path under a file, a read-only or full disk, missing permissions or a missing
        bucket raise :class:`~ckpt.errors.CheckpointDirError` here, before any training.
        """
        self._check_root()

    def _check_root(self) -> list[tuple[str, str]] | None:
        """:meth:`check_root`; the coordinator gets the root's listing it made (else None)."""
        entries = _root_check.check_root(self.root, self.storage_options, self._group)
        if self._leased:
            take_lease(self.lease, self._group, self.root)
            if self.lease is not None:  # the saves of the jobs it took over are dead
                self._saves.forget_runs(self.lease.took_over)
        return entries

    # -- resume --------------------------------------------------------------------------

    def resume(self, *, must: bool = False, this_job_only: bool = False) -> int | None:
        """Load the newest committed checkpoint that verifies; return its step, or None.

        Collective. Checks the root first (:meth:`check_root`). None, touching nothing,
        when the root holds no committed checkpoint (said at WARNING on rank 0: a typo in
        the root must not pass for a fresh run); ``must=True`` makes that a
        :class:`~ckpt.errors.CheckpointNotFoundError`. Reshards to this world size; a
        checkpoint that fails verification is reported (``fallback`` event) and the
        previous one used. Raises :class:`~ckpt.errors.CheckpointShapeError` for other
        shapes, :class:`~ckpt.errors.NoLoadableCheckpointError` when none loads or the
        root holds only quarantined ones. Every tier in order (:mod:`ckpt.tiers`).

        ``this_job_only``: for a job launched not to resume (the trainer's ``--resume
        false``) whose torchrun restarts must resume their own work: only a checkpoint an
        earlier attempt of this job wrote (:func:`~ckpt.tiers.resume.earlier_attempts`);
        the first attempt loads nothing.
        """
        storage = Storage(self.root, self.storage_options)
        existed, siblings = fresh_start.root_facts(storage) if self.rank == 0 else (None, [])
        entries = self._check_root()
        this_job = earlier_attempts(self._group) if this_job_only else None
        if this_job_only and this_job is None:
            return None
        # One listing of the root for the whole resume: the root check's, on the
        # coordinator (the only rank that reads the catalog); load reuses it.
        catalog = Catalog(storage, entries)
        walk = ResumeWalk(
            self.root,
            app=self.app,
            capture=self._state,
            group=self._group,
            rank=self.rank,
            world_size=self.world_size,
            rng=self.rng,
            seed=self.seed,
            emit=self._emit,
            param_groups=self.options.param_groups,
            this_job=this_job,
        )
        walk.fresh_start_note = fresh_start.fresh_start_message(
            self.root,
            restart_count=_env.run_identity()[1],
            periodic=self.options.saves_periodically,
            root_existed=existed,
            siblings=siblings,
        )
        step = walk.run(catalog, self._tiers, must=must)
        if walk.info is not None:
            self.last_resume = walk.info
            self._saves.resumed(walk.committed_step, walk.resumed_durable)
        return step

    # -- save ----------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether the durable tier's policy says ``step`` is due (``every`` steps; a clock
        policy is asked without deciding, on this rank's clock)."""
        return self._decisions.peek(self._durable, step)

    def maybe_save(self, step: int, *, final: bool = False) -> str | None:
        """Offer ``step`` to every tier in order; each saves when its policy says it is due.

        Durable: every ``every`` steps (async with ``async_save``) and at ``final``
        (synchronous: the run ends on a commit). Returns the durable checkpoint's URL (an
        async save's: where it will be committed), or None when it did not save or the save
        failed (logged, ``checkpoint_failed`` event; training goes on, up to
        ``max_failures``). Memory tier (``memory_every``): a snapshot committed on every
        rank's node when this returns. Tiers due at one step save one capture of the state.
        """
        self._loop.offered(step, final=final)
        request = SaveRequest(step, self._state, final=final)
        url = None
        for tier in self._tiers:
            if self._decisions.due(tier, step, final=final):
                saved = tier.save(request)
                if tier is self._durable:
                    url = saved
        return url

    def save(self, step: int, *, blocking: bool = True, emergency: bool = False) -> str | None:
        """Save ``step`` now (collective); returns the URL, or None when the save failed.

        ``blocking=False`` returns once the state is staged (async). A step already
        committed by this manager is not saved again. A background save that failed is
        reported (event) before this one starts. Raises
        :class:`~ckpt.errors.TooManySaveFailuresError` (not for ``emergency``) once
        ``max_failures`` saves failed in a row.
        """
        request = SaveRequest(step, self._state, blocking=blocking, emergency=emergency)
        return self._durable.save(request)

    def wait(self, timeout: float | None = None) -> str | None:
        """Wait for a background save (all ranks); return the newest committed URL or None."""
        self._saves.collect(timeout)
        step = self._saves.last_committed_step
        return None if step is None else self._saves.url(step)

    @property
    def last_committed_step(self) -> int | None:
        """Step of the newest checkpoint this manager committed or resumed from."""
        return self._saves.last_committed_step

    @property
    def last_save_s(self) -> float | None:
        """Wall seconds of the last save that finished, sync or async (staging + persist)."""
        return self._saves.last_save_s

    @property
    def retention(self) -> RetentionPolicy | None:
        return self._saves.retention

    @property
    def failures(self) -> SaveFailures:
        """Durable saves failed since the last commit, and the ``max_failures`` stop."""
        return self._saves.failures

    @property
    def consecutive_failures(self) -> int:
        """Durable saves that failed since the last commit (emergency saves included)."""
        return self.failures.consecutive

    @property
    def max_failures(self) -> int:
        return self.failures.max_failures

    # Read-only views of the options, as the attributes of the same names were before
    # the options object.
    every = option_view("every")
    async_save = option_view("async_save")
    memory_every = option_view("memory_every")
    param_groups = option_view("param_groups")

    # -- emergency saves (the saver protocol of ``elastic.RunGuard``) ----------------------

    def expected_save_s(self) -> float:
        """Seconds a synchronous save of this state is expected to take on this rank.

        The duration of the last save that finished (async included: staging and
        persist), else an estimate from the bytes this rank holds.
        """
        return expected_save_s(self.last_save_s, self.app.local_bytes())

    def emergency_save(self, step: int) -> bool:
        """Commit ``step`` synchronously after a termination signal (collective).

        Waits for a background save first; returns True when ``step`` is committed.
        """
        self._saves.collect()
        if self.last_committed_step == step:
            return True
        return self.save(step, blocking=True, emergency=True) is not None

    def inject_non_finite(self) -> list[str]:
        """Fill this rank's part of every floating parameter of the state's models with NaN
        (a divergence drill: ``elastic``'s ``nan`` fault); their names. Not a collective."""
        return self.app.fill_parameters(float("nan"))

    def inject_storage_fault(self, spec: str) -> None:
        """Arm storage faults (``ckpt-storage:phase=..:error=..`` or ``PHASE:KIND``) for
        this manager's next storage calls; the fault grammar of ``elastic.FaultPlan``."""
        self.faults.install(*parse_storage_faults(spec))

    # -- lifetime ------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Close the tiers, the durable one first, and release the root (all ranks).

        The durable tier waits for a background save and frees the staging buffers; the
        others are told the newest durable commit. Call before ``destroy_process_group``. A
        failed background save is reported (event, log); close does not raise for it.
        """
        if self._closed:
            return
        self._closed = True
        failure: BaseException | None = None
        for tier in reversed(self._tiers):
            try:
                tier.close(self.last_committed_step, timeout)
            except CheckpointError as exc:
                logger.error("rank %d: closing the %s tier failed: %s", self.rank, tier.name, exc)
            except BaseException as exc:  # the other tiers and the lease are closed first
                failure = failure or exc
        self._loop.closing(self.last_committed_step)
        self._group = self._saves.session.process_group = None
        if self.lease is not None:
            self.lease.close()  # released: the next job on this root starts at once
        if failure is not None:
            raise failure

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
