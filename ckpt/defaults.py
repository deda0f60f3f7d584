"""The one process-wide object: what the one-off ``ckpt.save``/``ckpt.load`` share.

A :class:`~ckpt.manager.CheckpointManager` owns its saver, storage faults and gloo
group; the thin module functions (``ckpt.save``, ``ckpt.load``, ``ckpt.close``,
``ckpt.wait_pending``) have no owner, so they share one :class:`ProcessDefaults`,
created on first use (never at import): the async saver (its at-exit drain is
registered by the first async save), the storage fault registry (``CKPT_STORAGE_FAULTS``
is read when it is created) and the checkpoint gloo group cached per default process
group. Nothing else in ``ckpt`` keeps mutable module state.
"""

from __future__ import annotations

import threading
from typing import Any

from ckpt.async_save import AsyncSaver
from ckpt.faults import FaultRegistry


class ProcessDefaults:
    """The saver, fault registry and checkpoint group of the one-off functions."""

    def __init__(self) -> None:
        self.saver = AsyncSaver()
        self.faults = FaultRegistry(read_env=True)
        self._groups: dict[int, Any] = {}
        self._lock = threading.Lock()

    def checkpoint_group(self, default_group: Any, create: Any) -> Any:
        """The gloo group for checkpoint collectives over ``default_group`` (made once)."""
        key = id(default_group)
        with self._lock:
            group = self._groups.get(key)
            if group is None:
                group = create()
                self._groups.clear()  # a previous default group is gone; drop its subgroup
                self._groups[key] = group
            return group

    def release_groups(self) -> None:
        """Forget the cached checkpoint group; call before ``destroy_process_group``."""
        with self._lock:
            self._groups.clear()


_CREATE_LOCK = threading.Lock()
_defaults: list[ProcessDefaults] = []
"""Holds the one instance once created (the module's only mutable state)."""


def process_defaults() -> ProcessDefaults:
    """The process's :class:`ProcessDefaults`, created on the first call."""
    if not _defaults:
        with _CREATE_LOCK:
            if not _defaults:
                _defaults.append(ProcessDefaults())
    return _defaults[0]


def created() -> ProcessDefaults | None:
    """The instance if one was created, without creating it."""
    return _defaults[0] if _defaults else None
