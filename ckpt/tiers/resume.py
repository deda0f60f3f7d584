"""One resume of a :class:`~ckpt.manager.CheckpointManager`: tiers in order, newest first.

:class:`ResumeWalk` is what :meth:`CheckpointManager.resume
<ckpt.manager.CheckpointManager.resume>` runs: the coordinator finds the durable head
(one listing of the root), then each tier (:mod:`ckpt.tiers`, in the manager's order:
by default the memory tier's snapshots first when it is on, then the durable root)
offers candidates, newest first,
and every candidate goes through the same steps whatever its tier: the shape check,
fresh optimizers, the RNG decision, the per-rank layout, the tier's verified load,
pushing the state into the objects, the ``resume`` event and the WARNING that says
where the run resumed from. The walk decides nothing about saving: it reports what it
loaded (:attr:`ResumeWalk.info`, :attr:`ResumeWalk.committed_step`) and the manager
keeps it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ckpt import dist as _dist
from ckpt import env
from ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointShapeError,
    StateApplyError,
)
from ckpt.format.layout import STOCK_DCP_REASON
from ckpt.loading.restore import LoadResult, SkippedCheckpoint, refuse_only_quarantined, set_aside
from ckpt.root.catalog import REFUSED, Catalog, stock_dcp_names
from ckpt.state import per_rank
from ckpt.state.app_state import AppState, param_group_changes, shape_mismatch
from ckpt.state.capture import MANAGER_META_KEY, StateCapture
from ckpt.state.rng import (
    RNG_STATE_KEY,
    capture_rng,
    reseed_process,
    restore_rng,
    rng_device,
    rng_key,
)
from ckpt.state.state_check import LoadableState
from ckpt.tiers import Candidate, DurableHead, Emit, ResumeScope, Tier, manager_record
from runcore import events as ev

logger = logging.getLogger("ckpt.manager")  # the manager's messages: one logger to filter


@dataclass(frozen=True, slots=True)
class ResumeInfo:
    """What :meth:`CheckpointManager.resume <ckpt.manager.CheckpointManager.resume>` restored."""

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
    """The tier it came from: ``"durable"`` (the root), ``"memory"`` (a memory-tier
    snapshot, ``memory_every``) or another tier's name."""
    run_id: str = ""
    """The run id that wrote the checkpoint (said at WARNING when it is not this run's)."""


def earlier_attempts(group: Any) -> tuple[str, int] | None:
    """``(run id, job-wide restart count)`` when an earlier attempt of this job may have
    written checkpoints (same ``TORCHELASTIC_RUN_ID``, a lower restart count: what
    ``resume(this_job_only=True)`` loads); None on the first attempt. Collective (one
    small all_gather: ranks restarted apart agree on the highest count)."""
    run_id, local_restarts = env.run_identity()
    restarts = max(_dist.Collective(group).all_gather(local_restarts))
    return None if restarts == 0 else (run_id, restarts)


class ResumeWalk:
    """One resume over ``tiers`` (collective: every rank walks the same candidates).

    With more than one tier (the memory tier on, say) the walk reports its choice: a
    ``tier_choice`` event, and ``tier`` on the ``resume`` event.
    """

    def __init__(
        self,
        root: str,
        *,
        app: AppState,
        capture: StateCapture,
        group: Any,
        rank: int,
        world_size: int,
        rng: bool,
        seed: int,
        emit: Emit,
        param_groups: str = "checkpoint",
        this_job: tuple[str, int] | None = None,
    ) -> None:
        self.root = root
        self.app = app
        self._capture = capture
        self._group = group
        self.rank = rank
        self.world_size = world_size
        self.rng = rng
        self.seed = seed
        self._emit = emit
        self._tier_names: tuple[str, ...] = ()
        """The walk's tiers, in order, when it reports its choice (more than one)."""
        self.param_groups = param_groups
        self.this_job = this_job
        """(run id, job restart count): resume only a durable checkpoint this job wrote in
        an earlier attempt (``CheckpointManager.resume(this_job_only=True)``)."""
        self.info: ResumeInfo | None = None
        """What was loaded (None: nothing)."""
        self.committed_step: int | None = None
        """The newest durable commit after this resume (a memory snapshot is not one)."""
        self.resumed_durable: int | None = None
        """The durable checkpoint resumed from: retention must keep it until a newer commit."""
        self.fresh_start_note: str | None = None
        """What a start from step 0 means here (:mod:`ckpt.loading.fresh_start`), said by
        rank 0 when nothing is resumed."""

    def run(self, catalog: Catalog, tiers: list[Tier], *, must: bool) -> int | None:
        """Load the first candidate that fits; its step, or None when there is nothing."""
        coll = _dist.Collective(self._group)

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
        if len(tiers) > 1:
            self._tier_names = tuple(tier.name for tier in tiers)
        if self.this_job is not None and head is not None and not self._of_this_job(head):
            if self.rank == 0:
                logger.warning(
                    "rank 0: not resuming step %d under %s: an earlier attempt of this job "
                    "did not write it (run %r, restart %d), and resume is off except for this "
                    "job's own restarts",
                    head.step, self.root, head.run_id, head.restart_count,
                )  # fmt: skip
            head = None
            tiers = [tier for tier in tiers if not tier.strict]
        scope = ResumeScope(catalog, head)
        for tier in tiers:
            for cand in tier.candidates(scope):
                loaded = self._resume_from(tier, cand, scope, must)
                if loaded is not None:
                    return None if loaded < 0 else loaded
            tier.exhausted()
        self._tier_choice(None, 0, scope)
        if self.this_job is None:
            refuse_only_quarantined(coll, catalog, self.root)  # damaged work is no fresh start
        return self._nothing_to_resume(must, catalog)

    def _of_this_job(self, head: DurableHead) -> bool:
        assert self.this_job is not None
        run_id, restarts = self.this_job
        return head.run_id == run_id and head.restart_count < restarts

    def _resume_from(
        self,
        tier: Tier,
        cand: Candidate,
        scope: ResumeScope,
        must: bool,
    ) -> int | None:
        """Resume from one candidate: its step; None to try the next; -1 for "nothing".

        A checkpoint whose values the objects refuse (:class:`StateApplyError` on some
        rank) is not used: a snapshot tier goes on to the next tier; the durable tier
        tries the older committed checkpoints. When an older one applies, the refused
        ones were damaged: they are quarantined at ERROR. When none does, the code (or
        its objects) changed, not the checkpoints: the first refusal is raised, and
        every checkpoint stays in place."""
        refused: list[SkippedCheckpoint] = []
        while True:
            try:
                loaded = self._resume_once(tier, cand, scope, must, refused)
            except _NotApplied as exc:
                skip = exc.skip
                if self.rank == 0:
                    logger.error(
                        "rank 0: %s step %d could not be applied: %s; trying %s",
                        tier.name, skip.step, skip.reason,
                        "the previous one" if tier.strict else "the next tier",
                    )  # fmt: skip
                self._emit(
                    ev.FALLBACK, skip.step, tier=tier.name, url=skip.url, path=skip.path,
                    reason=skip.reason,
                )  # fmt: skip
                if not tier.strict:
                    scope.notes.append(f"{tier.name} step {skip.step} rejected: {skip.reason}")
                    return None
                refused.append(skip)
                if self.rank == 0:
                    scope.catalog.mark(skip.step, REFUSED, skip.reason)  # the walk skips it
                continue
            break
        if refused and loaded is not None and loaded >= 0:
            coll = _dist.Collective(self._group)
            for skip in refused:  # an older checkpoint applied: these were damaged
                set_aside(scope.catalog, coll, skip, self._sink_quarantined)
        return loaded

    def _sink_quarantined(self, event: dict[str, Any]) -> None:
        fields = {k: v for k, v in event.items() if k not in ("event", "step")}
        self._emit(ev.QUARANTINE, int(event["step"]), **fields)

    def _resume_once(
        self,
        tier: Tier,
        cand: Candidate,
        scope: ResumeScope,
        must: bool,
        refused: list[SkippedCheckpoint],
    ) -> int | None:
        """One try of :meth:`_resume_from` (``refused``: checkpoints whose values did not
        apply, skipped by this try)."""
        saved_shapes = self.app.canonical_shapes(cand.record.get("shapes", {}))
        problem = shape_mismatch(self.app.tensor_shapes(), saved_shapes)
        if problem is not None:
            if tier.strict:
                raise CheckpointShapeError(
                    f"checkpoint {self.root} (step {cand.step}) was written for a different "
                    f"model: {problem}; load it with the model it was saved from, or use "
                    "another root"
                )
            scope.notes.append(
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
            layout = self._capture.per_rank_layout(cand.record, cand.world_size)
            template = self.app.state_dict(skip_optimizers=fresh)
            per_rank.move_out(template, *layout)
            if want_rng:
                template[RNG_STATE_KEY] = {rng_key(self.rank): capture_rng(rng_device())}
            loadable = LoadableState(template)  # numpy values as they were saved
            result, rng_loaded = tier.load(cand, loadable.plain, want_rng, scope)
            if result is not None:
                loadable.finish()
        except CheckpointError as exc:
            if tier.strict:
                raise
            scope.notes.append(f"{tier.name} step {cand.step} rejected: {exc}")
            if self.rank == 0:
                logger.error(
                    "%s snapshot of step %d rejected, trying the next tier: %s",
                    tier.name, cand.step, exc,
                )  # fmt: skip
            self._emit(
                ev.FALLBACK,
                cand.step,
                tier=tier.name,
                url=cand.url or self.root,
                path=getattr(exc, "path", ""),
                reason=str(exc),
            )
            return None
        if result is None and refused:
            first = refused[0]
            raise StateApplyError(
                f"no committed checkpoint under {self.root} could be applied to this job's "
                f"objects (step {first.step}: {first.reason}); the same refusal by every "
                "checkpoint means the code or the objects changed since they were written: "
                "resume with the code that wrote them, or start a new root. Every checkpoint "
                "is left in place.",
                key=first.path,
            )
        if result is None:  # every committed checkpoint vanished between listing and loading
            self._nothing_to_resume(must)
            return -1
        per_rank.move_back(template, *layout)
        loaded = self._finish(result, template, rng_loaded, fresh, started, tier)
        tier.resumed(cand)
        head = scope.head
        if tier.strict:
            self.committed_step = self.resumed_durable = loaded
        else:
            self.committed_step = head.step if head is not None else None
        self._tier_choice(tier, loaded, scope)
        return loaded

    def _apply(
        self,
        result: LoadResult,
        tier: Tier,
        template: dict[str, Any],
        fresh: list[str],
        rng_restored: bool,
    ) -> None:
        """Put the loaded values into the objects (and the RNG state into the generators),
        on every rank; raises :class:`_NotApplied` on every rank when one refused them."""
        problem = ""
        path = ""
        try:
            self.app.load(template, skip_optimizers=fresh)
            if rng_restored:
                path = RNG_STATE_KEY
                restore_rng(template[RNG_STATE_KEY][rng_key(self.rank)], rng_device())
        except StateApplyError as exc:
            problem, path = str(exc), exc.key
        except Exception as exc:  # the RNG state: a value of the wrong type or size
            problem = f"the RNG state refused: {type(exc).__name__}: {exc}"
        told = _dist.Collective(self._group).all_gather((problem, path))
        for rank, (said, where) in enumerate(told):
            if said:
                raise _NotApplied(
                    SkippedCheckpoint(
                        step=int(result.step),
                        url=tier.url(result),
                        reason=f"rank {rank}: {said}" if len(told) > 1 else said,
                        path=where,
                    )
                )

    def _nothing_to_resume(self, must: bool, catalog: Catalog) -> None:
        """A resume that found no committed checkpoint: an error with ``must``, else said
        (naming the stock DCP checkpoints the root holds: a user of torchtitan or plain
        ``dcp.save`` expects them to be resumed)."""
        stock = ""
        if must or self.rank == 0:
            try:
                names = stock_dcp_names(catalog)
            except Exception:
                names = []
            if names:
                more = f" and {len(names) - 3} more" if len(names) > 3 else ""
                shown = ", ".join(names[:3]) + more
                stock = f"; it holds stock DCP checkpoints ({shown}): {STOCK_DCP_REASON}"
        if must:
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {self.root} and resume is required "
                f"(must=True / --resume must); check the root, or resume only if one exists{stock}"
            )
        if self.rank == 0:
            note = self.fresh_start_note or (
                f"no committed checkpoint under {self.root}: starting from step 0"
            )
            logger.warning("rank 0: %s%s", note, stock)

    def _tier_choice(self, tier: Tier | None, step: int, scope: ResumeScope) -> None:
        """The ``tier_choice`` event of a resume over several tiers: which tier (None:
        none) and why."""
        if not self._tier_names:
            return
        head = scope.head
        durable = None if head is None else head.step
        # The durable tier is the last one, the others are tried before it.
        *others, last = self._tier_names
        before = " or ".join(others)
        against = f"{last} {durable}" if durable is not None else f"no {last} checkpoint"
        if tier is None:
            why = f"nothing to resume from: no usable {before} snapshot, no {last} checkpoint"
        elif tier.strict:
            why = f"{tier.name} step {step}: no usable {before} snapshot newer than it"
        else:
            why = f"{tier.name} step {step} newer than {against}"
        if scope.notes:
            why += " (" + "; ".join(scope.notes) + ")"
        if self.rank == 0:
            logger.info("rank 0: resume tier: %s", why)
        timings = tier.timings if tier is not None else None
        extra = {"timings": {k: round(v, 4) for k, v in timings.items()}} if timings else {}
        name = tier.name if tier is not None else "none"
        self._emit(ev.TIER_CHOICE, step, tier=name, reason=why, durable_step=durable, **extra)

    def _say_param_groups(self, constructed: dict[str, Any], step: int) -> None:
        """Say which optimizer settings the checkpoint replaced, or keep the constructed ones."""
        changes = param_group_changes(constructed, self.app.param_groups())
        if not changes:
            return
        keep = self.param_groups == "constructed"
        if keep:
            self.app.keep_param_groups(constructed)
        if self.rank != 0:
            return
        listed = "; ".join(changes[:8]) + (
            f" and {len(changes) - 8} more" if len(changes) > 8 else ""
        )
        if keep:
            logger.warning(
                "rank 0: resumed step %d keeping the optimizer settings this run was built "
                "with (param_groups=\"constructed\"), not the checkpoint's: %s",
                step, listed,
            )  # fmt: skip
        else:
            logger.warning(
                "rank 0: resumed step %d: the checkpoint's optimizer settings replace the ones "
                "this run was built with: %s. CheckpointManager(..., param_groups="
                "\"constructed\") keeps the new ones",
                step, listed,
            )  # fmt: skip

    def _report_batch_changes(self, step: int) -> None:
        """A ``batch_change`` event per sampler that continued with another global batch."""
        for key, sampler in self._capture.data_positions().items():
            change = getattr(sampler, "batch_change", None)
            if isinstance(change, dict):
                self._emit(ev.BATCH_CHANGE, step, key=key, **change)

    def _finish(
        self,
        result: LoadResult,
        template: dict[str, Any],
        rng_loaded: bool,
        fresh: list[str],
        started: float,
        tier: Tier,
    ) -> int:
        """Push a loaded checkpoint into the objects, set RNG, record and report the resume."""
        constructed = self.app.param_groups()
        old_world = int(result.manifest.world_size)
        loaded_step = int(result.step)
        rng_restored = rng_loaded and old_world == self.world_size
        self._apply(result, tier, template, fresh, rng_restored)
        self._say_param_groups(constructed, int(result.step))
        self._capture.mark_resumed(int(result.step))
        self._report_batch_changes(int(result.step))
        if not rng_restored and self.rng:
            reseed_process(self.seed, loaded_step, self.rank)
        user_meta = {k: v for k, v in result.metadata.items() if k != MANAGER_META_KEY}
        url = tier.url(result)
        self.info = info = ResumeInfo(
            step=loaded_step,
            url=url,
            old_world_size=old_world,
            new_world_size=self.world_size,
            rng_restored=rng_restored,
            bytes_read=int(result.bytes_read),
            duration_s=time.monotonic() - started,
            metadata=user_meta,
            tier=tier.name,
            run_id=result.manifest.attempt.run_id,
        )
        if self.rank == 0:
            this_run = env.run_identity()[0]
            # One line: a relaunch under a new run id is the usual case, and a root shared
            # by mistake is the rare one the run ids let a reader see.
            other = (
                f"; step {loaded_step} was written by run {info.run_id!r}, not by this run "
                f"{this_run!r} (a relaunch or a requeue; if not, check --ckpt-dir)"
                if info.run_id != this_run
                else ""
            )
            logger.warning(
                "rank 0: resumed step %d from %s (%s tier, world size %d -> %d, RNG %s, %.2f s)%s",
                loaded_step, url, tier.name, old_world, self.world_size,
                "restored" if rng_restored else "re-derived", info.duration_s, other,
            )  # fmt: skip
        extra = {"tier": tier.name} if self._tier_names else {}
        self._emit(
            ev.RESUME,
            loaded_step,
            url=url,
            old_world_size=old_world,
            new_world_size=self.world_size,
            rng_restored=rng_restored,
            bytes=int(result.bytes_read),
            duration_s=round(info.duration_s, 4),
            **extra,
        )
        return loaded_step


class _NotApplied(Exception):
    """A loaded checkpoint's values were refused by an object on some rank (every rank
    raises it: the refusal was agreed)."""

    def __init__(self, skip: SkippedCheckpoint) -> None:
        super().__init__(skip.reason)
        self.skip = skip
