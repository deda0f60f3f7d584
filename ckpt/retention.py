"""Retention: which checkpoints to keep, decided by a pure function, then applied.

Policy: keep the newest ``keep_last`` committed checkpoints (at least one, so the
newest is never deleted) and, permanently, every committed checkpoint whose step
is a multiple of ``keep_every`` and every ``protect``-ed step (the one a run resumed
from). Quarantined checkpoints (:mod:`ckpt.quarantine`) are neither committed nor
partial: retention never touches them (``python -m ckpt gc --quarantined`` does). Partial directories older than the newest
committed checkpoint belong to dead attempts and are deleted; newer partial
directories may be a save in flight and are kept.

Deleting a committed checkpoint removes its COMPLETE marker first, so a deletion
interrupted half-way (a kill at any point of a prune) leaves a partial directory,
never a torn "committed" one, and the next prune deletes that partial directory.

``DEFAULT_RETENTION`` (keep the newest 3) is what ``CheckpointManager`` and the
trainer apply after every commit unless told otherwise: a month-long run must not
fill its disk or bucket.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckpt.layout import COMPLETE_NAME, checkpoint_dirname
from ckpt.storage import Storage

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RetentionPolicy:
    """What to keep."""

    keep_last: int
    """Keep this many newest committed checkpoints (>= 1)."""
    keep_every: int | None = None
    """Also keep, forever, committed checkpoints whose step is a multiple of this."""
    delete_partial: bool = True
    """Delete partial directories older than the newest committed checkpoint."""
    protect: frozenset[int] = frozenset()
    """Committed steps never deleted whatever their age (a manager protects the checkpoint
    it resumed from)."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.keep_last, bool)
            or not isinstance(self.keep_last, int)
            or self.keep_last < 1
        ):
            raise ValueError(
                f"keep_last must be an int >= 1 (the newest is never deleted), got {self.keep_last!r}"
            )
        if self.keep_every is not None and (
            not isinstance(self.keep_every, int) or self.keep_every < 1
        ):
            raise ValueError(f"keep_every must be an int >= 1 or None, got {self.keep_every!r}")


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    """The decision: steps to keep and to delete, each with a reason."""

    keep: tuple[int, ...]
    delete: tuple[int, ...]
    delete_partial: tuple[int, ...]
    reasons: dict[int, str] = field(default_factory=dict)


def plan_retention(
    committed_steps: Sequence[int], partial_steps: Sequence[int], policy: RetentionPolicy
) -> RetentionPlan:
    """Decide what to keep; pure (no I/O), newest first in every tuple."""
    committed = sorted(set(committed_steps), reverse=True)
    keep: list[int] = []
    delete: list[int] = []
    reasons: dict[int, str] = {}
    for index, step in enumerate(committed):
        if step in policy.protect:
            keep.append(step)
            reasons[step] = "protected (resumed from)"
        elif index < policy.keep_last:
            keep.append(step)
            reasons[step] = "newest" if index == 0 else f"among the newest {policy.keep_last}"
        elif policy.keep_every and step % policy.keep_every == 0:
            keep.append(step)
            reasons[step] = f"multiple of keep_every={policy.keep_every}"
        else:
            delete.append(step)
            reasons[step] = "older than the newest kept"
    partial_delete: list[int] = []
    newest = committed[0] if committed else None
    for step in sorted(set(partial_steps) - set(committed), reverse=True):
        if policy.delete_partial and newest is not None and step < newest:
            partial_delete.append(step)
            reasons.setdefault(step, "partial, older than the newest committed (dead attempt)")
    return RetentionPlan(tuple(keep), tuple(delete), tuple(partial_delete), reasons)


def apply_retention(
    root: str | Storage, policy: RetentionPolicy, *, dry_run: bool = False
) -> RetentionPlan:
    """List ``root``, plan with :func:`plan_retention` and delete (unless ``dry_run``).

    Run by one process (the coordinator, or the ``gc`` CLI), never by every rank.
    """
    from ckpt.discovery import PARTIAL, as_storage, list_checkpoints

    storage = as_storage(root)
    infos = list_checkpoints(storage)
    # Quarantined directories are neither: kept for forensics until `ckpt gc --quarantined`.
    plan = plan_retention(
        [i.step for i in infos if i.committed],
        [i.step for i in infos if i.status == PARTIAL],
        policy,
    )
    if dry_run:
        return plan
    for step in plan.delete:
        dirname = checkpoint_dirname(step)
        storage.remove(f"{dirname}/{COMPLETE_NAME}")
        storage.remove_tree(dirname)
        logger.info("ckpt: retention deleted %s", storage.url(dirname))
    for step in plan.delete_partial:
        storage.remove_tree(checkpoint_dirname(step))
        logger.info("ckpt: retention deleted partial %s", storage.url(checkpoint_dirname(step)))
    return plan


DEFAULT_RETENTION = RetentionPolicy(keep_last=3)
"""The default of ``CheckpointManager(retention=...)`` and of the trainer's ``checkpoint.keep_last``."""


def describe(policy: RetentionPolicy | None) -> str:
    """One line for the start of a run: what retention keeps."""
    if policy is None:
        return "retention off: every committed checkpoint is kept (the root grows without bound)"
    text = f"retention keeps the newest {policy.keep_last} committed checkpoint(s)"
    if policy.keep_every:
        text += f" and every step that is a multiple of {policy.keep_every}"
    return text + "; older ones are deleted after each commit"
