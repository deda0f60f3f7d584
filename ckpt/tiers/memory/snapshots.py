"""The memory tier as a :class:`ckpt.tiers.Tier`: snapshots every K steps, and a resume
from the newest one newer than the durable head.

Save: on its ``EveryNSteps(memory_every, at_final=False)`` policy, the step's capture is
snapshotted into node memory (:meth:`ckpt.tiers.memory.tier.MemoryTier.snapshot`); a failure is
reported, never raised. Resume: the snapshots newer than the durable head
(:func:`ckpt.tiers.memory.restore.survey`), one assembled under a ``ckptmem://`` root
(:func:`ckpt.tiers.memory.restore.materialize`) and loaded with the normal verified load, then
what the run will not need pruned. Close: replication finished, and the snapshots dropped
when the durable tier has caught up.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch.distributed as dist

from ckpt.errors import CorruptCheckpointError
from ckpt.loading.restore import LoadResult, load_in
from ckpt.saving.policy import EveryNSteps, SaveDecisionPolicy
from ckpt.saving.saves import DurableSaves
from ckpt.storage import StorageOptions
from ckpt.storage.faults import FaultRegistry
from ckpt.tiers import Candidate, Emit, ResumeScope, SaveRequest, TierContext, manager_record
from ckpt.tiers.memory import restore
from ckpt.tiers.memory.tier import MemoryTier, SnapshotError
from runcore import events as ev

logger = logging.getLogger("ckpt.manager")  # the manager's messages: one logger to filter


class MemorySnapshots:
    """One rank's memory tier (:class:`MemoryTier`) behind the tier interface."""

    name = "memory"
    strict = False

    def __init__(
        self, memory: MemoryTier, *, policy: SaveDecisionPolicy, saves: DurableSaves, emit: Emit
    ) -> None:
        self.memory = memory
        self.policy = policy
        self._saves = saves  # the manager's group, rank, event sink and staging buffers
        self._emit = emit
        self._rank = saves.rank
        self.timings: dict[str, float] = {}

    # -- save ------------------------------------------------------------------------------

    def save(self, request: SaveRequest) -> None:
        """Snapshot the step (collective), committed on every rank's node when this returns.

        A failure is logged and reported (``memory_snapshot_failed``, phase ``write``; a
        background replication that failed since the last one: phase ``replicate``), never
        raised: the durable tier is still there and training goes on.
        """
        step = request.step
        state, meta, _ = request.capture(reuse_shapes=True)
        for error in self.memory.replication_errors():
            self._emit(ev.MEMORY_SNAPSHOT_FAILED, step, phase="replicate", error=error,
                       rank=self._rank)  # fmt: skip
        try:
            self.memory.snapshot(step, state, meta)
        except SnapshotError as exc:
            logger.error("rank %d step %d: %s; training continues", self._rank, step, exc)
            self._emit(ev.MEMORY_SNAPSHOT_FAILED, step, phase="write", error=str(exc),
                       rank=self._rank)  # fmt: skip

    # -- load ------------------------------------------------------------------------------

    def candidates(self, scope: ResumeScope) -> list[Candidate]:
        head = scope.head
        durable = None if head is None else (head.step, head.run_id, head.restart_count)
        surveyed = time.monotonic()
        found = restore.survey(self.memory, durable)
        self.timings["survey_s"] = time.monotonic() - surveyed
        scope.notes.extend(found.notes)
        return [
            Candidate(
                int(cand.step),
                int(cand.manifest.world_size),
                manager_record(cand.manifest.metadata),
                handle=cand,
                url=self.memory.url(int(cand.step)),
            )
            for cand in found.candidates
        ]

    def load(
        self, cand: Candidate, template: dict[str, Any], want_rng: bool, scope: ResumeScope
    ) -> tuple[LoadResult | None, bool]:
        """Assemble and load one snapshot (collective); a first failure is retried once
        with every copy's crc32c checked first (a corrupt copy, a good replica)."""
        for verify in (False, True):
            started = time.monotonic()
            assembled = restore.materialize(self.memory, cand.handle, template, verify=verify)
            self.timings["assemble_s"] = time.monotonic() - started
            try:
                # A snapshot assembled for this rank under a ckptmem:// root (node-local
                # maps and shipped ranges; no storage faults): the same verified load. Each
                # rank's snapshot is already in its own memory: nothing to read once.
                session = self._saves.session.emitting(self._saves.sink(tier=self.name))
                node_local = StorageOptions(
                    fsync=False, read_once=False, faults=FaultRegistry(read_env=False)
                )
                result = load_in(
                    session.storing(node_local), template, assembled.url, step=cand.step
                )
            except CorruptCheckpointError as exc:
                if verify:
                    raise
                scope.notes.append(
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
        return self.memory.url(int(result.step))

    def resumed(self, cand: Candidate) -> None:
        restore.prune(self.memory, cand.handle)

    def exhausted(self) -> None:
        restore.prune(self.memory, None)

    # -- lifetime --------------------------------------------------------------------------

    def close(self, durable_step: int | None, timeout: float | None) -> None:
        """Finish replication; drop this rank's snapshots if the durable tier caught up."""
        self.memory.close(durable_step)


def build_memory_tier(ctx: TierContext) -> MemorySnapshots | None:
    """The memory tier of a manager when ``options.memory_every`` is on (collective: it
    creates the tier's gloo groups and directory); None when it is off."""
    options = ctx.options
    if not options.memory_every:
        return None
    memory = MemoryTier(
        ctx.saves.root,
        memory_dir=options.memory_dir,
        distributed=dist.is_available() and dist.is_initialized(),
        allow_non_finite=options.allow_non_finite,
    )
    policy = EveryNSteps(options.memory_every, at_final=False)
    return MemorySnapshots(memory, policy=policy, saves=ctx.saves, emit=ctx.emit)
