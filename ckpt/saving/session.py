"""What the save and load engine runs under: one :class:`Session`.

The engine (:func:`ckpt.saving.commit.save_in`, :func:`ckpt.loading.restore.load_in`) takes
a session: the saver that keeps at most one save in flight (and whose staging buffers the
loads reuse), the process group its collectives run over, the storage options, where its
events go, and whether load templates are partial on purpose.

- :func:`ckpt.save` and :func:`ckpt.load` are thin wrappers: each call runs in
  :func:`default_session` (the process's one-off saver, ``ckpt.defaults``, with the
  arguments given).
- A :class:`~ckpt.manager.CheckpointManager` makes one session of its own
  (:class:`~ckpt.saving.saves.DurableSaves`: its saver, its checkpoint group, its
  storage options with its fault registry) that every tier's saves and loads use, with
  each call's events routed where the tier says (:meth:`Session.emitting`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckpt.saving.async_save import AsyncSaver, default_saver
from ckpt.storage import StorageOptions

EventSink = Callable[[dict[str, Any]], None]
"""Where the engine's events go (``{"event": name, ...}``, :mod:`runcore.events`)."""


@dataclass(slots=True, kw_only=True)
class Session:
    """The context of the engine's saves and loads (module docstring)."""

    saver: AsyncSaver
    """At most one save in flight per saver: a save or load waits for it first."""
    process_group: Any = None
    """The group the collectives run over (None: the default group, or one process)."""
    storage_options: StorageOptions | None = None
    on_event: EventSink | None = None
    partial_templates: bool = False
    """True for a manager's tiers, whose load templates leave out on purpose what is not
    this rank's (other ranks' RNG state): checkpoint keys a template has no place for are
    then not reported as not loaded."""

    def emitting(self, on_event: EventSink | None) -> Session:
        """This session with events going to ``on_event`` (one call's sink)."""
        return dataclasses.replace(self, on_event=on_event)

    def storing(self, storage_options: StorageOptions | None) -> Session:
        """This session with other storage options (one call's, e.g. a node-local root)."""
        return dataclasses.replace(self, storage_options=storage_options)


def default_session(
    *,
    process_group: Any = None,
    storage_options: StorageOptions | None = None,
    on_event: EventSink | None = None,
) -> Session:
    """The session of :func:`ckpt.save`/:func:`ckpt.load`: the process's one-off saver."""
    return Session(
        saver=default_saver(),
        process_group=process_group,
        storage_options=storage_options,
        on_event=on_event,
    )
