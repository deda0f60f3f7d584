"""The durable saves of a :class:`~ckpt.manager.CheckpointManager`: run, collect, count.

The manager decides when to save (every N steps, final, emergency) and what
(:mod:`ckpt.state.capture`); :class:`DurableSaves` runs one (``ckpt.saving.commit.save``, sync or in
the background on the manager's :class:`~ckpt.saving.async_save.AsyncSaver`), collects the one
in flight at the next save (its outcome counts then), keeps the newest commit and the
retention protection of the checkpoint a run resumed from.

:class:`SaveFailures` counts durable saves that failed in a row (emergency saves
included), logs and reports each (``checkpoint_failed``), and raises
:class:`~ckpt.errors.TooManySaveFailuresError` once ``max_failures`` is reached or when
the final save failed: a job must not train on, or exit 0, without a checkpoint. The
count moves in lockstep on every rank (a save's outcome, and an async save's collected
at the next save, is the same everywhere), so every rank raises at the same step.

:func:`expected_save_s` is what ``elastic.RunGuard`` asks before an emergency save: does
a synchronous save fit in the time a termination signal leaves?
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ckpt.errors import (
    CheckpointError,
    NonFiniteStateError,
    SaveFailedError,
    StorageError,
    TooManySaveFailuresError,
)
from ckpt.format.layout import checkpoint_dirname
from ckpt.root.retention import RetentionPolicy
from ckpt.saving import async_save as _async
from ckpt.saving.commit import save_in
from ckpt.saving.session import Session
from ckpt.state.app_state import AppState
from ckpt.state.capture import Captured, StateCapture
from ckpt.storage import Storage, StorageOptions
from runcore import events as ev

logger = logging.getLogger("ckpt.manager")  # the manager's messages: one logger to filter

ESTIMATE_BYTES_PER_S = 50e6
"""Before any save was timed, an emergency save is assumed to write this fast..."""
ESTIMATE_FIXED_S = 2.0
"""...plus this much for the protocol's collectives and the commit."""


def expected_save_s(last_save_s: float | None, local_bytes: int) -> float:
    """The last finished save's duration, else an estimate from the bytes a rank holds."""
    if last_save_s is not None:
        return last_save_s
    return ESTIMATE_FIXED_S + local_bytes / ESTIMATE_BYTES_PER_S


class SaveFailures:
    """Failed durable saves since the last commit, and the stop policy (every rank)."""

    def __init__(self, max_failures: int, *, rank: int, root: str, emit: Callable[..., None]):
        self.validate(max_failures)
        self.max_failures = max_failures
        self.consecutive = 0
        self.last = ""
        """``step N: error`` of the last failure."""
        self._rank = rank
        self._root = root
        self._emit = emit

    @staticmethod
    def validate(max_failures: object) -> None:
        if isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < 0:
            raise ValueError(
                f"max_failures must be an int >= 0 (0: never stop for failed saves), "
                f"got {max_failures!r}"
            )

    @property
    def failing(self) -> bool:
        return bool(self.max_failures) and self.consecutive >= self.max_failures

    def committed(self) -> None:
        self.consecutive = 0

    def record(self, step: int, exc: CheckpointError, *, emergency: bool = False) -> None:
        """Count, log and report a failed save (every rank: saves fail on every rank at once)."""
        self.consecutive += 1
        self.last = f"step {step}: {exc}"
        failures = f"{self.consecutive} in a row"
        if self.max_failures:
            failures += f", the job stops at {self.max_failures}"
        if emergency:
            logger.error(
                "rank %d: emergency checkpoint at step %d FAILED (%s): %s; a relaunch resumes "
                "from the newest committed checkpoint",
                self._rank, step, failures, exc,
            )  # fmt: skip
        else:
            logger.error(
                "rank %d step %d: checkpoint save failed (%s): %s",
                self._rank, step, failures, exc,
            )  # fmt: skip
        self._emit(
            ev.CHECKPOINT_FAILED,
            step,
            error=str(exc),
            rank=self._rank,
            consecutive=self.consecutive,
            **({"emergency": True} if emergency else {}),
            **({"non_finite": sorted(exc.keys)} if isinstance(exc, NonFiniteStateError) else {}),
        )

    def stop_if_failing(self, step: int, last_committed: int | None) -> None:
        """Raise on every rank together once ``max_failures`` saves in a row failed."""
        if not self.failing:
            return
        last = "none" if last_committed is None else f"step {last_committed}"
        raise TooManySaveFailuresError(
            f"rank {self._rank} step {step}: {self.consecutive} checkpoint saves in a row "
            f"failed under {self._root} (max_failures={self.max_failures}); the last one, "
            f"{self.last}. Stopping instead of training on without checkpoints "
            f"(newest committed: {last}). Fix the storage and relaunch; it resumes from there"
        )

    def final_failed(self, step: int) -> TooManySaveFailuresError:
        """The error for a ``final`` save that did not commit: the run must not end on it."""
        return TooManySaveFailuresError(
            f"rank {self._rank}: the final checkpoint at step {step} under {self._root} failed "
            f"({self.last}); the run did not end on a commit. Fix the storage and "
            "run again: it resumes from the newest committed checkpoint"
        )


class DurableSaves:
    """Runs a manager's durable saves and keeps their outcome (every rank, in lockstep)."""

    def __init__(
        self,
        root: str,
        *,
        app: AppState,
        capture: StateCapture,
        storage_options: StorageOptions,
        group: Any,
        retention: RetentionPolicy | None,
        failures: SaveFailures,
        sink: Callable[..., Callable[[dict[str, Any]], None]],
        rank: int,
        allow_non_finite: bool | Sequence[str] = False,
        root_guard: Callable[[], None] | None = None,
    ) -> None:
        self.root = root
        self.allow_non_finite = allow_non_finite
        """Keys whose NaN or inf values do not stop a commit (:mod:`ckpt.saving.finite`)."""
        self.root_guard = root_guard
        """Run by the coordinator before a save writes (the root's owner lease)."""
        self._app = app
        self._capture = capture
        self.session = Session(
            saver=_async.AsyncSaver(),
            process_group=group,
            storage_options=storage_options,
            partial_templates=True,
        )
        """What every tier's saves and loads run under: the manager's saver (its staging
        buffers and the save in flight; the loads reuse its buffers too), checkpoint group
        and storage options; its tiers' load templates are partial on purpose."""
        self.retention = retention
        self.failures = failures
        self.sink = sink
        self.rank = rank
        self.last_save_s: float | None = None
        self.last_committed_step: int | None = None
        self._in_flight: dict[int, dict[str, Any]] = {}

    def run(
        self,
        step: int,
        *,
        blocking: bool,
        emergency: bool = False,
        captured: Captured | None = None,
    ) -> str | None:
        """Save ``step`` (collective): its URL, or None when it failed (counted, reported)."""
        self.collect()
        if self.last_committed_step == step:
            return self.url(step)
        if not emergency and self.failures.failing:
            return None  # the caller stops the job: no new save to wait for
        started = time.monotonic()
        state, meta, fresh = captured if captured is not None else self._capture.capture(step)
        self._capture.detect_per_rank(state, meta)
        extra = {"emergency": True} if emergency else {}
        background = not blocking
        try:
            result = save_in(
                self.session.emitting(self.sink(**extra)),
                state,
                self.root,
                step,
                metadata=meta,
                retention=self.retention,
                async_save=background,
                overlap_staging=self._overlap(fresh) if background else None,
                allow_non_finite=self.allow_non_finite,
                root_guard=self.root_guard,
            )
        except (SaveFailedError, StorageError) as exc:
            self.failures.record(step, exc, emergency=emergency)
            return None
        if background:
            assert isinstance(result, _async.PendingSave)
            self._in_flight[step] = extra
            if self.rank == 0:
                logger.info(
                    "rank 0 step %d: checkpoint staged in %.3f s, committing in the background to %s",
                    step,
                    time.monotonic() - started,
                    result.url,
                )
            return result.url
        assert isinstance(result, str)
        self._committed(step, time.monotonic() - started)
        if self.rank == 0:
            logger.info("rank 0 step %d: checkpoint committed at %s", step, result)
        return result

    def _overlap(self, fresh: list[str]) -> list[torch.optim.Optimizer] | None:
        # The staging copy overlaps the next forward/backward; each optimizer's next
        # step() waits for it. Only when optimizers are the only in-place writers of
        # the saved tensors, which is what a training loop between two saves does.
        optimizers = [opt for key, (opt, _) in self._app.optimizers.items() if key not in fresh]
        return optimizers or None

    def url(self, step: int) -> str:
        return Storage(self.root, self.session.storage_options).url(checkpoint_dirname(step))

    def collect(self, timeout: float | None = None) -> None:
        """Wait for the background save in flight; record its outcome (all ranks)."""
        pending = self.session.saver.pending
        if pending is None or pending.step not in self._in_flight:
            return
        self._in_flight.pop(pending.step)
        try:
            self.session.saver.wait_pending(timeout)
        except (SaveFailedError, StorageError) as exc:
            self.failures.record(pending.step, exc)
            return
        self._committed(pending.step, pending.duration_s)

    def _committed(self, step: int, duration_s: float | None) -> None:
        self.last_save_s = duration_s
        self.last_committed_step = step
        self.failures.committed()
        # A newer commit exists: the checkpoint resumed from ages out like any other.
        if self.retention is not None and self.retention.protect:
            self.retention = dataclasses.replace(self.retention, protect=frozenset())

    def forget_runs(self, run_ids: list[str]) -> None:
        """Runs whose owner lease this job took over: retention clears their uncommitted
        directories like this run's own (they can never commit)."""
        if run_ids and self.retention is not None:
            dead = self.retention.dead_runs | frozenset(run_ids)
            self.retention = dataclasses.replace(self.retention, dead_runs=dead)

    def resumed(self, committed_step: int | None, durable_step: int | None) -> None:
        """After a resume: the newest commit, and never prune the checkpoint resumed from
        (``durable_step``) before this run commits a newer one."""
        self.last_committed_step = committed_step
        if durable_step is not None and self.retention is not None:
            self.retention = dataclasses.replace(self.retention, protect=frozenset({durable_step}))
