"""Retention: which checkpoints to keep, decided by a pure function, then applied.

Policy: keep the newest ``keep_last`` committed checkpoints (at least one, so the
newest is never deleted) and, permanently, every committed checkpoint whose step
is a multiple of ``keep_every`` and every ``protect``-ed step (the one a run resumed
from). Quarantined checkpoints (:mod:`ckpt.root.quarantine`) are neither committed nor
partial: retention never touches them (``python -m ckpt gc --quarantined`` does). Partial directories older than the newest
committed checkpoint belong to dead attempts and are deleted (when their records name the
pruning run, or a run whose owner lease it took over: ``dead_runs``); newer partial
directories may be a save in flight and are kept.

Deleting a committed checkpoint writes an ``ATTEMPT`` record marked ``deleting`` into it,
then removes its COMPLETE marker, then the rest, so a deletion interrupted half-way (a
kill at any point of a prune) leaves a partial directory, never a torn "committed" one,
and the next prune (of any run) deletes that partial directory: its record proves it.

What the plan says to delete is deleted only when it is provably the library's
(:mod:`ckpt.root.ownership`): every file in the directory one it writes (and, committed, one
its manifest lists), and a partial directory's records naming the run that prunes. A
directory that fails this is left whole and said at WARNING (:attr:`RetentionPlan.refused`);
a committed checkpoint renamed by hand ("renamed") or whose manifest.json was damaged after
its commit ("damaged") is quarantined, never deleted.

``DEFAULT_RETENTION`` (keep the newest 3) is what ``CheckpointManager`` and the
trainer apply after every commit unless told otherwise: a month-long run must not
fill its disk or bucket.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ckpt.errors import CheckpointError, ObjectNotFoundError
from ckpt.format.layout import ATTEMPT_NAME, COMPLETE_NAME
from ckpt.root import ownership
from ckpt.root.catalog import PARTIAL, RENAMED, SET_ASIDE, Catalog, CheckpointInfo
from ckpt.root.quarantine import quarantine
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
    dead_runs: frozenset[str] = frozenset()
    """Run ids whose uncommitted directories are cleared like the pruning run's own: runs
    whose owner lease that run took over (:mod:`ckpt.root.lease`), which can never commit."""

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
    refused: dict[int, str] = field(default_factory=dict)
    """Steps the plan deleted that were left in place, and why (not provably ours)."""
    set_aside: dict[int, str] = field(default_factory=dict)
    """Renamed or damaged committed checkpoints quarantined instead: step -> where they are
    kept."""


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
    root: str | Storage,
    policy: RetentionPolicy,
    *,
    dry_run: bool = False,
    run_id: str | None = None,
    said: set[str] | None = None,
    catalog: Catalog | None = None,
) -> RetentionPlan:
    """List ``root``, plan with :func:`plan_retention` and delete (unless ``dry_run``).

    Run by one process (the coordinator, or the ``gc`` CLI), never by every rank.
    ``run_id``: the run pruning after its commit; a partial directory is deleted only
    when its records name this run (``None``, the ``gc`` CLI: any run's, when recorded).
    ``said``: URLs already reported as left alone (each is said at WARNING once).
    ``catalog``: the root's listing when the caller already made one (``gc``).
    """
    if catalog is None:
        catalog = Catalog(root if isinstance(root, Storage) else Storage(root))
    storage = catalog.storage
    infos = {info.step: info for info in catalog}
    # Quarantined directories are neither: kept for forensics until `ckpt gc --quarantined`.
    plan = plan_retention(
        [i.step for i in infos.values() if i.committed],
        [i.step for i in infos.values() if i.status == PARTIAL],
        policy,
    )
    if dry_run:
        return plan
    for entry in catalog.foreign():
        ownership.say_left_alone(
            said, entry.url, f"retention left {entry.url} alone: {entry.reason}"
        )
    refused: dict[int, str] = {}
    for step in (*plan.delete, *plan.delete_partial):
        info = infos[step]
        why = _not_ours(storage, info, run_id, policy.dead_runs)
        if why:
            refused[step] = why
            ownership.say_left_alone(said, info.url, f"retention left {info.url} in place: {why}")
            continue
        if info.committed:
            # the claim first: a prune killed from here on leaves a directory that is
            # provably ours and condemned, which the next prune of any run finishes
            try:
                storage.write_bytes(
                    f"{info.dirname}/{ATTEMPT_NAME}",
                    ownership.attempt_record(
                        run_id or "gc", 0, "retention", socket.gethostname(), deleting=True
                    ),
                    phase="retention",
                )
            except ObjectNotFoundError:
                pass  # another prune (the manager's, a `ckpt gc`) removed it meanwhile
            storage.remove(f"{info.dirname}/{COMPLETE_NAME}")
        storage.remove_tree(info.dirname)
        kind = "" if info.committed else "partial "
        logger.info("ckpt: retention deleted %s%s", kind, info.url)
    set_aside = {
        info.step: set_aside_renamed(storage, info, said)
        for info in infos.values()
        if info.status in SET_ASIDE
    }
    return replace(plan, refused=refused, set_aside={k: v for k, v in set_aside.items() if v})


def _not_ours(
    storage: Storage, info: CheckpointInfo, run_id: str | None, dead_runs: frozenset[str]
) -> str:
    """Why the directory of ``info`` must not be deleted; empty when it may be."""
    try:
        listing = storage.child(info.dirname).list_files()
    except CheckpointError as exc:
        return f"cannot list it ({exc})"
    foreign = ownership.strangers(listing, info.manifest if info.committed else None)
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        return (
            f"it holds files this library did not write ({', '.join(foreign[:3])}{more}); "
            "move them out, then `python -m ckpt gc` can remove it"
        )
    if info.committed or ownership.being_deleted(storage, info.dirname):
        return ""
    owner = ownership.uncommitted_owner(storage, info.dirname)
    if owner is None:
        return "no record says which run wrote it (no ATTEMPT record, no manifest)"
    if run_id is not None and owner != run_id and owner not in dead_runs:
        return (
            f"it belongs to run {owner!r}, not to this run {run_id!r} (it may be that job's "
            "save in flight); `python -m ckpt gc` removes it once that job is gone"
        )
    return ""


def set_aside_renamed(storage: Storage, info: CheckpointInfo, said: set[str] | None = None) -> str:
    """Quarantine a committed checkpoint that is never loaded nor deleted; its new URL.

    ``info`` is *renamed* (found under another step's name) or *damaged* (its
    manifest.json no longer the one its COMPLETE vouches for): its files are a committed
    checkpoint, so it is set aside, never deleted. Said at WARNING. Returns "" when it
    could not be moved (said too; tried again next time).
    """
    renamed = info.status == RENAMED
    reason = f"{info.reason}; its directory name says step {info.step}" if renamed else info.reason
    what = "renamed" if renamed else "damaged"
    try:
        kept = quarantine(storage, info.step, reason, "" if renamed else "manifest.json")
    except CheckpointError as exc:
        ownership.say_left_alone(said, info.url, f"could not set aside {what} {info.url}: {exc}")
        return ""
    logger.warning(
        "ckpt: %s was %s: quarantined, not deleted; its files are kept at %s",
        info.url,
        info.reason,
        kept.url,
    )
    return kept.url


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
