"""The one process-wide object: what the one-off ``ckpt.save``/``ckpt.load`` share.

A :class:`~ckpt.manager.CheckpointManager` owns its saver, storage faults and gloo
group; the thin module functions (``ckpt.save``, ``ckpt.load``, ``ckpt.close``,
``ckpt.wait_pending``) have no owner, so they share one :class:`ProcessDefaults`,
created on first use (never at import). It holds the checkpoint gloo group cached per
default process group and the objects the modules that own their types make on first
use: the async saver (``ckpt.saving.async_save.default_saver``; its at-exit drain is
registered by the first async save), the storage fault registry
(``ckpt.storage.faults.default_registry``; ``CKPT_STORAGE_FAULTS`` is read when it is made),
the S3 clients (``ckpt.storage.s3``), and what saves keep between saves: the global
plans of the layouts saved (``ckpt.saving.planning.kept_plans``) and the shard writer's
``torch.save`` templates (``ckpt.saving.writer.save_templates``). Nothing else in ``ckpt`` keeps mutable
module state. This module imports nothing of ``ckpt``: the modules above ask it, it
never asks them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


class ProcessDefaults:
    """The checkpoint group and the shared objects of the one-off functions."""

    def __init__(self) -> None:
        self._parts: dict[Hashable, Any] = {}
        self._groups: dict[int, Any] = {}
        self._per_group: set[Hashable] = set()
        self._lock = threading.Lock()

    def part(self, key: Hashable, create: Callable[[], T], *, per_group: bool = False) -> T:
        """The object stored under ``key``, made by ``create()`` on first use.

        ``create`` runs outside the lock (making an S3 client takes a while); when two
        threads make one at once, the first stored wins and the other is dropped.
        ``per_group``: the object describes the process group(s) of its time (the save
        plans kept, which hold device meshes); :meth:`release_groups` drops it.
        """
        with self._lock:
            found = self._parts.get(key)
        if found is None:
            made = create()
            with self._lock:
                found = self._parts.setdefault(key, made)
                if per_group:
                    self._per_group.add(key)
        return found

    def existing(self, key: Hashable) -> Any:
        """The object stored under ``key``, or None (makes nothing)."""
        with self._lock:
            return self._parts.get(key)

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
        """Forget the cached checkpoint group and the objects made ``per_group``; call
        before ``destroy_process_group``."""
        with self._lock:
            self._groups.clear()
            for key in self._per_group:
                self._parts.pop(key, None)
            self._per_group.clear()


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
