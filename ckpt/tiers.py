"""Where a resume can load from: the :class:`Tier` interface and the durable root.

:meth:`CheckpointManager.resume <ckpt.manager.CheckpointManager.resume>` walks the tiers
in order (memory first when it is on, then durable) and, per tier, its candidates
newest first. A :class:`Tier` says which candidates it has and loads one into a state
template with the normal verified load (``ckpt.restore.load``); the manager does
everything else once, for every tier: the shape check, fresh optimizers, the RNG
decision, per-rank layout, pushing the state into the objects, events and logs.

- ``strict`` tiers (durable) raise on a candidate that does not fit (other shapes, a
  load error after the loader's own fallback); other tiers (memory) note why and let
  the next candidate, then the next tier, try.
- :meth:`Tier.resumed` / :meth:`Tier.exhausted` end a tier's part (the memory tier
  prunes the snapshots it will not need).

The memory tier's adapter, :class:`ckpt.memory.MemorySnapshots`, lives with the tier
(``ckpt/memory/snapshots.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckpt.capture import MANAGER_META_KEY
from ckpt.discovery import Catalog
from ckpt.errors import StateMismatchError
from ckpt.restore import LoadResult
from ckpt.restore import load as _load
from ckpt.rng import RNG_STATE_KEY
from ckpt.storage import StorageOptions

logger = logging.getLogger("ckpt.manager")  # the manager's messages: one logger to filter

Sink = Callable[..., Callable[[dict[str, Any]], None]]
"""``sink(**extra)``: the manager's event sink for ``ckpt.restore.load``."""


@dataclass(frozen=True, slots=True)
class DurableHead:
    """The newest committed durable checkpoint, as the coordinator listed it."""

    step: int
    world_size: int
    record: dict[str, Any]
    run_id: str
    restart_count: int


@dataclass(slots=True)
class Candidate:
    """One checkpoint a tier could resume from."""

    step: int
    world_size: int
    record: dict[str, Any]
    """The manager's record in its manifest (keys, shapes, fresh optimizers, RNG, per-rank)."""
    handle: Any = None
    """The tier's own reference (a memory-tier survey candidate)."""
    timings: dict[str, float] = field(default_factory=dict)


class Tier(Protocol):
    name: str
    strict: bool

    def candidates(self, head: DurableHead | None, notes: list[str]) -> list[Candidate]: ...

    def load(
        self, cand: Candidate, template: dict[str, Any], want_rng: bool, notes: list[str]
    ) -> tuple[LoadResult | None, bool]:
        """Load ``cand`` into ``template``: (result or None if it vanished, RNG loaded)."""
        ...

    def url(self, result: LoadResult) -> str: ...

    def resumed(self, cand: Candidate) -> None: ...

    def exhausted(self) -> None: ...


def manager_record(metadata: dict[str, Any]) -> dict[str, Any]:
    record = metadata.get(MANAGER_META_KEY, {})
    return record if isinstance(record, dict) else {}


class DurableTier:
    """The checkpoint root: its newest committed checkpoint, with the loader's fallback."""

    name = "durable"
    strict = True

    def __init__(
        self,
        root: str,
        *,
        catalog: Catalog,
        group: Any,
        sink: Sink,
        storage_options: StorageOptions,
        saver: Any,
        rank: int,
    ) -> None:
        self.root = root
        self._catalog = catalog
        self._group = group
        self._sink = sink
        self._options = storage_options
        self._saver = saver
        self._rank = rank

    def candidates(self, head: DurableHead | None, notes: list[str]) -> list[Candidate]:
        if head is None:
            return []
        return [Candidate(head.step, head.world_size, head.record)]

    def load(
        self, cand: Candidate, template: dict[str, Any], want_rng: bool, notes: list[str]
    ) -> tuple[LoadResult | None, bool]:
        try:
            return self._load(template), want_rng
        except StateMismatchError as exc:
            if not want_rng:
                raise
            # A fallback landed on a checkpoint of another world size (no RNG key for us).
            logger.warning("rank %d: retrying the load without RNG state: %s", self._rank, exc)
            template.pop(RNG_STATE_KEY)
            return self._load(template), False

    def _load(self, template: dict[str, Any]) -> LoadResult | None:
        return _load(
            template,
            self.root,
            missing_ok=True,
            process_group=self._group,
            on_event=self._sink(),
            storage_options=self._options,
            catalog=self._catalog,
            _saver=self._saver,
        )

    def url(self, result: LoadResult) -> str:
        return result.url

    def resumed(self, cand: Candidate) -> None:
        pass

    def exhausted(self) -> None:
        pass
