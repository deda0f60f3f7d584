"""``CheckpointManager``: one object that owns a run's checkpoints.

A training script builds one on every rank, right after its model, optimizer(s) and
scheduler(s), and calls it at three places::

    manager = ckpt.CheckpointManager(
        args.ckpt_dir,
        {"model": model, "optim": optimizer, "sched": scheduler, "sampler": sampler},
        options=ckpt.CheckpointOptions(every=50, async_save=True),
    )
    start = manager.resume() or 0           # newest committed checkpoint, any world size
    for step in range(start + 1, max_steps + 1):
        ...                                 # forward, backward, optimizer.step()
        manager.maybe_save(step, final=step == max_steps)
    manager.close()

The manager holds an ordered list of tiers (:mod:`ckpt.tiers`; by default the memory
tier when it is on, then the durable root: :mod:`ckpt.tiers.defaults`) and knows none of
them by name: at each step it offers the step to every tier whose save-decision policy
says it is due (:mod:`ckpt.saving.policy`), a resume walks the tiers' candidates in order
(:mod:`ckpt.loading.resume`), and :meth:`close` closes them. The mechanisms are their own
modules: :mod:`ckpt.options` (every setting, validated), :mod:`ckpt.state.capture` (what a
save holds), :mod:`ckpt.saving.saves` (running durable saves, the one in flight, the failure
count), :mod:`ckpt.lifecycle.root_check` and :mod:`ckpt.lifecycle.lease` (the root).

Every method that touches checkpoints is a collective: every rank calls it, in the
same order. A failed save is logged, reported as a ``checkpoint_failed`` event and
training goes on (the previous committed checkpoint stays the newest).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from ckpt import dist as _dist
from ckpt import env as _env
from ckpt.errors import CheckpointError
from ckpt.lifecycle import root_check as _root_check
from ckpt.lifecycle.lease import JobIdentity, RootLease, take_lease
from ckpt.lifecycle.retention import RetentionPolicy
from ckpt.lifecycle.retention import describe as describe_retention
from ckpt.loading import fresh_start
from ckpt.loading.discovery import Catalog
from ckpt.loading.resume import ResumeInfo, ResumeWalk
from ckpt.options import CheckpointOptions
from ckpt.saving.decisions import SaveDecisions
from ckpt.saving.saves import DurableSaves, SaveFailures, expected_save_s
from ckpt.state.app_state import AppState
from ckpt.state.capture import StateCapture
from ckpt.storage import Storage, StorageOptions
from ckpt.storage.faults import FaultRegistry, parse_storage_faults
from ckpt.tiers import SaveRequest, Tier, TierBuilder, TierContext
from ckpt.tiers.defaults import DEFAULT_TIERS
from runcore import events as ev
from runcore.redact import redact_fields

__all__ = ["CheckpointManager", "EventCallback", "ResumeInfo"]

logger = logging.getLogger(__name__)

EventCallback = Callable[..., None]
"""``on_event(name, step, **fields)``: the signature of a run recorder's ``event``."""


def _option_view(name: str) -> property:
    """A read-only attribute that reads ``self.options.<name>``."""
    return property(
        lambda self: getattr(self.options, name), doc=f"``options.{name}`` (read-only)."
    )


class CheckpointManager:
    """Saves and resumes one run's state under one root; every rank holds one.

    ``state`` maps names to the objects to checkpoint (see :mod:`ckpt.state.app_state`):
    models, optimizers, LR schedulers and other ``Stateful`` objects, plain values.
    Plain values are put back into the same dict by :meth:`resume`.

    ``options``: a :class:`~ckpt.options.CheckpointOptions`, every setting below in one
    validated object; or the same settings as keyword arguments (``every=50,
    async_save=True``, and ``retention=`` a :class:`~ckpt.lifecycle.retention.RetentionPolicy` or
    None for ``keep_last``/``keep_every``), which build it (not both). ``rng``: save each
    rank's RNG under its own key; on resume it is restored when the world size is
    unchanged and re-derived from ``(seed, step, rank)`` otherwise. ``metadata``: a dict,
    or a function of the step returning one, stored in the manifest and returned by
    :meth:`resume` (``ResumeInfo.metadata``). ``on_event(name, step, **fields)`` receives
    ``checkpoint_saved``, ``checkpoint_loaded``, ``fallback``, ``checkpoint_failed`` and
    ``resume`` events (from the save thread too: it must be thread-safe). ``tiers``: the
    :data:`~ckpt.tiers.TierBuilder` functions of the tiers, in order (None:
    :data:`~ckpt.tiers.defaults.DEFAULT_TIERS`); exactly one strict tier, the durable
    root, and it comes last.

    Saves (:meth:`maybe_save`): durable every ``every`` steps and at ``final``;
    ``async_save``: periodic saves return once the state is staged (the copy itself
    overlaps the next forward/backward and the optimizers' next ``step()`` waits for
    it); the final and emergency saves are synchronous.

    Memory tier (opt-in): ``memory_every=K`` (0: off) also snapshots the state every K
    steps into node-local memory that outlives the process (``memory_dir``, else
    ``CKPT_MEMORY_DIR``, else ``/dev/shm/ckpt-memory-<uid>``), replicated in the background to
    a rank on another node, committed when :meth:`maybe_save` returns. :meth:`resume`
    takes the newest snapshot complete across the surviving nodes and newer than the
    durable head, verified and loaded like a durable checkpoint (resharding included),
    else falls back to the durable tier; ``tier_choice`` says which and why. Snapshots
    are never a durable commit. See docs/design.md ("Memory tier") for memory cost.

    Retention: ``keep_last`` (default 3; 0 keeps everything) and ``keep_every`` are
    applied by the coordinator after every commit, never to the checkpoint this run
    resumed from before a newer commit, to a partial directory newer than the newest
    commit (a save in flight) or to a quarantined one; the policy is said at WARNING on
    rank 0 when the manager is built.

    Failed saves: ``max_failures`` (default 3; 0: never stop) durable saves failing in a
    row make :meth:`maybe_save` raise :class:`~ckpt.errors.TooManySaveFailuresError` on
    every rank at the same step, and a failed ``final`` save raises it at once: a job
    must not train on, or exit 0, without a checkpoint. A commit resets the count.

    Optimizer settings: a resume loads each optimizer's param groups from the checkpoint
    (torch's ``load_state_dict``), so a changed ``--lr`` or weight decay would silently
    give way to the saved one; the values that differ are said at WARNING on rank 0.
    ``param_groups="constructed"`` keeps the values the optimizer was built with instead
    (a scheduler-driven ``lr`` keeps its place in the schedule, scaled to the new base
    lr). An optimizer stepped by an LR scheduler that is not in ``state`` is said at
    WARNING here: the schedule (its warm-up) would start over after every resume.

    Non-finite values: a save whose floating tensors hold a NaN or an infinity is not
    committed (:class:`~ckpt.errors.NonFiniteStateError`, a failed save: the policy above
    applies), nor is such a memory snapshot, so a diverged state never becomes the newest
    checkpoint; ``allow_non_finite`` exempts keys that hold them on purpose (``True``, or
    ``fnmatch`` patterns such as ``["model.*.mask"]``).

    One job per root: the coordinator takes the root's owner lease in :meth:`check_root`
    (so in :meth:`resume`; else at the first save), renews it in the background every
    ``lease_ttl_s / 4`` and releases it at :meth:`close`. Another job's fresh lease is a
    :class:`~ckpt.errors.RootLeaseError` before any training; an expired one is taken over
    (WARNING). Before each save writes, the root must still be the one it leased (not
    deleted, recreated or unmounted), else :class:`~ckpt.errors.RootChangedError`, a failed
    save. ``lease_ttl_s`` (default ``CKPT_LEASE_TTL_S``, else 60; 0: no lease); which
    launches count as one job: :mod:`ckpt.lifecycle.lease`.

    Construct it on every rank at the same point: with a process group it creates the
    checkpoint gloo group, which is a collective; ``setup_timeout_s`` bounds how long a
    rank waits there for the others (None: ``CKPT_COLLECTIVE_TIMEOUT_S``, 600 s, which
    still bounds the group's collectives afterwards). A job with a bound for a dead peer
    passes it: the trainer gives its peer timeout + 10 s.
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
        if options is None:
            options = CheckpointOptions.from_kwargs(**option_kwargs)
        elif not isinstance(options, CheckpointOptions):
            raise ValueError(f"options must be a ckpt.CheckpointOptions, got {options!r}")
        elif option_kwargs:
            raise ValueError(
                f"options= and the keyword argument(s) {', '.join(sorted(option_kwargs))} both "
                "given: put every setting in the CheckpointOptions"
            )
        options = options.options()
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
        self.storage_options = _with_faults(base, self.faults)
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
        self._tiers = _build_tiers(DEFAULT_TIERS if tiers is None else tiers, context)
        self._durable = self._tiers[-1]
        if self.rank == 0:
            _say_start(root, options, describe_retention(retention))
            for key in self.app.unsaved_schedulers():
                logger.warning(
                    "rank 0: state[%r] is stepped by an LR scheduler that is not in the "
                    "checkpoint state: after a resume its schedule (warm-up included) starts "
                    'over. Add the scheduler: CheckpointManager(root, {..., "sched": '
                    "scheduler})",
                    key,
                )
        self._closed = False
        self._final_step: int | None = None
        self._said_after_final = False
        self._last_step: int | None = None
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
        read back and deleted (:func:`~ckpt.lifecycle.root_check.check_root`), so a bad scheme, a
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

        Collective. Checks the root first (:meth:`check_root`). Returns None, touching
        nothing, when the root holds no committed checkpoint (said at WARNING on rank 0:
        a typo in the root must not pass for a fresh run); with ``must=True`` that is a
        :class:`~ckpt.errors.CheckpointNotFoundError` instead. Models and optimizers
        reshard to this world size; a checkpoint that fails verification is reported
        (``fallback`` event) and the previous one is used. Raises
        :class:`~ckpt.errors.CheckpointShapeError` for a checkpoint of other shapes and
        :class:`~ckpt.errors.NoLoadableCheckpointError` when none loads, or when the root
        holds only quarantined ones (never a fresh start over damaged work).

        One path for every tier (:mod:`ckpt.tiers`), in order: by default the memory
        tier's snapshots newer than the durable head first (when it is on), then the
        durable root.

        ``this_job_only``: for a job launched not to resume (the trainer's ``--resume
        false``), whose torchrun restarts must still resume their own work: only a
        checkpoint this job wrote in an earlier attempt (the same run id,
        ``TORCHELASTIC_RUN_ID``, and a lower restart count; the job-wide restart count is
        one small collective) is loaded; the first attempt loads nothing.
        """
        existed, siblings = (
            fresh_start.local_root_state(Storage(self.root, self.storage_options).root_path)
            if self.rank == 0 and Storage(self.root, self.storage_options).backend.scheme == "file"
            else (None, [])
        )
        entries = self._check_root()
        this_job = None
        if this_job_only:
            run_id, local_restarts = _env.run_identity()
            restarts = max(_dist.Collective(self._group).all_gather(local_restarts))
            if restarts == 0:
                return None
            this_job = (run_id, restarts)
        # One listing of the root for the whole resume: the root check's, on the
        # coordinator (the only rank that reads the catalog); load reuses it.
        catalog = Catalog(Storage(self.root, self.storage_options), entries)
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

        The durable tier saves every ``every`` steps and at ``final``: periodic saves are
        asynchronous with ``async_save``, a ``final`` save is synchronous, so the run ends
        on a commit. Returns the durable checkpoint's URL (for an async save: where it
        will be committed), or None when it did not save or the save failed (logged,
        ``checkpoint_failed`` event; training goes on, up to ``max_failures``).

        With ``memory_every``, every K-th step (not ``final``) first takes a memory-tier
        snapshot, committed on every rank's node when this returns (a failure is logged
        and reported as ``memory_snapshot_failed``; training goes on). Tiers due at the
        same step save one capture of the state.
        """
        self._say_stepping_after_final(step)
        self._last_step = step
        if final:
            self._final_step = step
        request = SaveRequest(step, self._state, final=final)
        url = None
        for tier in self._tiers:
            if self._decisions.due(tier, step, final=final):
                saved = tier.save(request)
                if tier is self._durable:
                    url = saved
        return url

    def _say_stepping_after_final(self, step: int) -> None:
        """WARNING (once) when a loop goes on after its ``final`` save: an epoch loop over
        the endless step loader, or a ``final`` flag computed wrong."""
        if self._final_step is None or step <= self._final_step or self._said_after_final:
            return
        self._said_after_final = True
        if self.rank == 0:
            logger.warning(
                "rank 0 step %d: training goes on after the final save at step %d "
                "(maybe_save(final=True)). An epoch loop over sampler.loader() never ends: "
                "use sampler.epoch_loader() for `for batch in loader` epochs",
                step, self._final_step,
            )  # fmt: skip

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
    every = _option_view("every")
    async_save = _option_view("async_save")
    memory_every = _option_view("memory_every")
    param_groups = _option_view("param_groups")

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
        others are told the newest durable commit after that (the memory tier drops
        snapshots it has caught up with). Call before ``destroy_process_group``. A failed
        background save is reported as an event and logged; close itself does not raise
        for it.
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
        self._say_unsaved_tail()
        self._group = self._saves.group = None
        if self.lease is not None:
            self.lease.close()  # released: the next job on this root starts at once
        if failure is not None:
            raise failure

    def _say_unsaved_tail(self) -> None:
        """WARNING (rank 0) at a normal close when the last steps given to ``maybe_save``
        are newer than the newest commit: a loop that never passed ``final=True`` (or
        called ``save``) loses them, and a relaunch starts before them."""
        last, committed = self._last_step, self.last_committed_step
        if sys.exc_info()[0] is not None:  # closed by an __exit__ on the way out of an error
            return
        if self.rank != 0 or last is None or self._final_step is not None:
            return
        if committed is not None and committed >= last:
            return
        logger.warning(
            "rank 0: closing after step %d, but the newest checkpoint is %s: the steps since "
            "are in no checkpoint and a relaunch repeats them. Pass final=True to the last "
            "maybe_save (maybe_save(step, final=step == max_steps)) or call save(step) before "
            "close",
            last, "none" if committed is None else f"step {committed}",
        )  # fmt: skip

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _with_faults(options: StorageOptions, registry: FaultRegistry) -> StorageOptions:
    return dataclasses.replace(options, faults=registry)


def _build_tiers(builders: Sequence[TierBuilder], context: TierContext) -> list[Tier]:
    """The tiers ``builders`` give (every rank, in order: a builder may be collective)."""
    tiers = [tier for build in builders if (tier := build(context)) is not None]
    names = [tier.name for tier in tiers]
    strict = [tier.name for tier in tiers if tier.strict]
    if len(set(names)) != len(names):
        raise ValueError(f"tiers: each tier needs its own name, got {names}")
    if len(strict) != 1 or not tiers[-1].strict:
        raise ValueError(
            f"tiers: exactly one strict tier (the durable root), and last, got {names} "
            f"with strict {strict}"
        )
    return tiers


def _say_start(root: str, options: CheckpointOptions, retention: str) -> None:
    """Rank 0's start-up lines: retention once per job (its first attempt), and a WARNING
    when torchrun may restart the job but nothing saves periodically."""
    if _env.run_identity()[1] == 0:
        logger.warning("rank 0: checkpoints under %s: %s", root, retention)
    else:
        logger.info("rank 0: checkpoints under %s: %s", root, retention)
    restarts = _env.max_restarts()
    if restarts > 0 and not options.saves_periodically:
        logger.warning("rank 0: %s", fresh_start.no_periodic_save_message(restarts))
