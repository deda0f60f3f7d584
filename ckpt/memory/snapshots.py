"""The memory tier as a :class:`ckpt.tiers.Tier`: its snapshots, for the one resume walk.

:meth:`CheckpointManager.resume <ckpt.manager.CheckpointManager.resume>` asks this
adapter for the snapshots newer than the durable head (:func:`ckpt.memory.restore.survey`),
has it assemble one under a ``ckptmem://`` root (:func:`ckpt.memory.restore.materialize`)
and load it with the normal verified load, and lets it prune what the run will not need.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ckpt.errors import CorruptCheckpointError
from ckpt.faults import FaultRegistry
from ckpt.memory import restore
from ckpt.memory.tier import MemoryTier, SnapshotError
from ckpt.restore import LoadResult
from ckpt.restore import load as _load
from ckpt.storage import StorageOptions
from ckpt.tiers import Candidate, DurableHead, Sink, manager_record
from runcore import events as ev

logger = logging.getLogger("ckpt.manager")  # the manager's messages: one logger to filter


class MemorySnapshots:
    """The memory tier's committed snapshots newer than the durable head (``ckpt.memory``)."""

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
        found = restore.survey(self.tier, durable)
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
            assembled = restore.materialize(self.tier, cand.handle, template, verify=verify)
            self.timings["assemble_s"] = time.monotonic() - started
            try:
                # A snapshot assembled for this rank under a ckptmem:// root (node-local
                # maps and shipped ranges; no storage faults): the same verified load.
                result = _load(
                    template,
                    assembled.url,
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
                assembled.release()
            self.timings["load_s"] = time.monotonic() - started - self.timings["assemble_s"]
            return result, want_rng
        raise AssertionError("unreachable")

    def url(self, result: LoadResult) -> str:
        return self.tier.url(int(result.step))

    def resumed(self, cand: Candidate) -> None:
        restore.prune(self.tier, cand.handle)

    def exhausted(self) -> None:
        restore.prune(self.tier, None)


def take_snapshot(
    tier: MemoryTier,
    step: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    rank: int,
    emit: Callable[..., None],
) -> None:
    """Snapshot ``step`` into ``tier`` (collective): what ``maybe_save`` does every K steps.

    A failure is logged and reported (``memory_snapshot_failed``, phase ``write``; a
    background replication that failed since the last one: phase ``replicate``), never
    raised: the durable tier is still there and training goes on.
    """
    for error in tier.replication_errors():
        emit(ev.MEMORY_SNAPSHOT_FAILED, step, phase="replicate", error=error, rank=rank)
    try:
        tier.snapshot(step, state, meta)
    except SnapshotError as exc:
        logger.error("rank %d step %d: %s; training continues", rank, step, exc)
        emit(ev.MEMORY_SNAPSHOT_FAILED, step, phase="write", error=str(exc), rank=rank)
