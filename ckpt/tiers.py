"""Where a resume can load from: the durable root and the memory tier, behind one interface.

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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckpt import memory_restore as _memory_restore
from ckpt.capture import MANAGER_META_KEY
from ckpt.discovery import Catalog
from ckpt.errors import CorruptCheckpointError, StateMismatchError
from ckpt.faults import FaultRegistry
from ckpt.memory_tier import MemoryTier
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


class MemorySnapshots:
    """The memory tier's committed snapshots newer than the durable head (``ckpt.memory_*``)."""

    name = "memory"
    strict = False

    def __init__(self, tier: MemoryTier, *, group: Any, sink: Sink, saver: Any, rank: int):
        self.tier = tier
        self._group = group
        self._sink = sink
        self._saver = saver
        self._rank = rank
        self.timings: dict[str, float] = {}

    def candidates(self, head: DurableHead | None, notes: list[str]) -> list[Candidate]:
        durable = None if head is None else (head.step, head.run_id, head.restart_count)
        surveyed = time.monotonic()
        found = _memory_restore.survey(self.tier, durable)
        self.timings["survey_s"] = time.monotonic() - surveyed
        notes.extend(found.notes)
        return [
            Candidate(
                int(cand.step),
                int(cand.manifest.world_size),
                manager_record(cand.manifest.metadata),
                handle=cand,
            )
            for cand in found.candidates
        ]

    def load(
        self, cand: Candidate, template: dict[str, Any], want_rng: bool, notes: list[str]
    ) -> tuple[LoadResult | None, bool]:
        """Assemble and load one snapshot (collective); a first failure is retried once
        with every copy's crc32c checked first (a corrupt copy, a good replica)."""
        for verify in (False, True):
            started = time.monotonic()
            restore = _memory_restore.materialize(self.tier, cand.handle, template, verify=verify)
            self.timings["assemble_s"] = time.monotonic() - started
            try:
                # A snapshot assembled for this rank under a ckptmem:// root (node-local
                # maps and shipped ranges; no storage faults): the same verified load.
                result = _load(
                    template,
                    restore.url,
                    step=cand.step,
                    process_group=self._group,
                    on_event=self._sink(tier=self.name),
                    storage_options=StorageOptions(
                        fsync=False, faults=FaultRegistry(read_env=False)
                    ),
                    _saver=self._saver,
                )
            except CorruptCheckpointError as exc:
                if verify:
                    raise
                notes.append(
                    f"memory step {cand.step}: a copy failed its check ({exc}); assembled "
                    "again from copies whose crc32c matches the manifest"
                )
                if self._rank == 0:
                    logger.warning(
                        "memory snapshot of step %d failed to load (%s); checking every copy",
                        cand.step,
                        exc,
                    )
                continue
            finally:
                restore.release()
            self.timings["load_s"] = time.monotonic() - started - self.timings["assemble_s"]
            return result, want_rng
        raise AssertionError("unreachable")

    def url(self, result: LoadResult) -> str:
        return self.tier.url(int(result.step))

    def resumed(self, cand: Candidate) -> None:
        _memory_restore.prune(self.tier, cand.handle)

    def exhausted(self) -> None:
        _memory_restore.prune(self.tier, None)
