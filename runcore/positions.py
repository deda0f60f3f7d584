"""Data positions a process holds, so that one left out of every checkpoint is said aloud.

A sampler that is not in a checkpoint manager's state starts again at sample 0 after
every restart: the run trains on, replaying the same data, with no sign. Nothing in
the manager's state leads to it, so the two meet here: ``elastic.ElasticSampler``
registers itself when built, ``ckpt.CheckpointManager`` claims the data positions in
its state, and at its first save warns about any registered one that moved and that
no manager claimed. Weak references only: this keeps nothing alive.
"""

from __future__ import annotations

import weakref
from typing import Any

_registered: weakref.WeakSet[Any] = weakref.WeakSet()
_claimed: weakref.WeakSet[Any] = weakref.WeakSet()


def register(position: Any) -> None:
    """A data position (``data_position() -> {"cursor": int, ...}``) now exists."""
    _registered.add(position)


def claim(position: Any) -> None:
    """``position`` is in a checkpoint manager's state (saved and restored with it)."""
    _claimed.add(position)


def unclaimed_moved() -> list[Any]:
    """Registered data positions that moved (cursor > 0) and that no manager claimed."""
    out = []
    for position in list(_registered):
        if position in _claimed:
            continue
        try:
            cursor = int(position.data_position()["cursor"])
        except Exception:  # a diagnostic must never break a save
            continue
        if cursor > 0:
            out.append(position)
    return out
