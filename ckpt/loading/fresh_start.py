"""What a start from step 0 means, said so that a lost run or a typo never passes for a new one.

A resume that finds nothing starts from step 0. That is right for a new run and wrong
for two others that look the same from inside: a restart after a failure of a job that
never committed a checkpoint (the steps before the failure are lost), and a root path
with a typo (a new, empty root beside the real one). Rank 0 says which it is, at
WARNING, from facts it has at hand: the agent's restart count, whether the root existed
before this manager created it, and, for a local root that did not exist, the sibling
directories that hold checkpoints.
"""

from __future__ import annotations

import os

from ckpt.format.layout import parse_checkpoint_dirname
from ckpt.storage import Storage

SIBLINGS_LISTED = 200
"""Entries of the root's parent looked at for roots with checkpoints (a typo's neighbours)."""


def local_root_state(path: str) -> tuple[bool, list[str]]:
    """``(exists, siblings)`` of a local root: whether it exists, and when it does not, the
    directories beside it that hold checkpoints (what a typo may have meant)."""
    if os.path.lexists(path):
        return True, []
    parent = os.path.dirname(os.path.normpath(path)) or "."
    found: list[str] = []
    try:
        with os.scandir(parent) as entries:
            for i, entry in enumerate(entries):
                if i >= SIBLINGS_LISTED:
                    break
                if entry.is_dir(follow_symlinks=False) and _holds_checkpoints(entry.path):
                    found.append(entry.path)
    except OSError:
        return False, []
    return False, sorted(found)[:3]


def root_facts(storage: Storage) -> tuple[bool | None, list[str]]:
    """:func:`local_root_state` of a local root, taken before a resume's root check creates
    it; ``(None, [])`` for an object store (a bucket prefix is never "created")."""
    if storage.backend.scheme != "file":
        return None, []
    return local_root_state(storage.root_path)


def _holds_checkpoints(path: str) -> bool:
    try:
        with os.scandir(path) as entries:
            return any(parse_checkpoint_dirname(e.name) is not None for e in entries)
    except OSError:
        return False


def fresh_start_message(
    root: str,
    *,
    restart_count: int,
    periodic: bool,
    root_existed: bool | None,
    siblings: list[str],
) -> str:
    """The WARNING of a resume that found no committed checkpoint (rank 0's words)."""
    head = f"no committed checkpoint under {root}: starting from step 0"
    if restart_count > 0:
        why = (
            "this manager saves no periodic checkpoint (every=0): pass every=N (steps) or "
            "every_s=S (seconds) to CheckpointManager/CheckpointOptions to bound what a "
            "failure costs"
            if not periodic
            else "no save committed before the failure"
        )
        return (
            f"{head}, but this is restart {restart_count} of the job: the steps trained "
            f"before the failure are lost ({why})"
        )
    if root_existed is False:
        hint = (
            f"; did you mean {' or '.join(siblings)}? (beside it, holding checkpoints)"
            if siblings
            else ""
        )
        return f"{head} (a new root: it did not exist){hint}"
    if root_existed:
        return f"{head} (the root exists but holds no committed checkpoint)"
    return head


def no_periodic_save_message(max_restarts: int) -> str:
    """The start-up WARNING of a manager with no periodic save under torchrun restarts."""
    return (
        f"no periodic checkpoint (every=0) while torchrun may restart this job "
        f"{max_restarts} time(s): a failure restarts training from step 0 (or from the last "
        "save this script makes itself); pass every=N (steps) or every_s=S (seconds) to "
        "CheckpointManager/CheckpointOptions to bound what a failure costs"
    )
