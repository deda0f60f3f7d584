"""The durable root as a :class:`ckpt.tiers.Tier`: the commit of record.

It saves with the manager's :class:`~ckpt.saving.saves.DurableSaves` (the same engine as the
manager's explicit ``save`` and ``emergency_save``) on its ``every`` policy, and applies
the failure stop after each save: ``max_failures`` in a row, or a ``final`` save that did
not commit, raise :class:`~ckpt.errors.TooManySaveFailuresError` on every rank at the same
step. A resume's candidate is the root's newest committed checkpoint, loaded with the
loader's own fallback to older ones.
"""

from __future__ import annotations

import logging
from typing import Any

from ckpt.errors import StateMismatchError
from ckpt.loading.restore import LoadResult, load_in
from ckpt.saving.policy import SaveDecisionPolicy
from ckpt.saving.saves import DurableSaves
from ckpt.state.rng import RNG_STATE_KEY
from ckpt.tiers import Candidate, ResumeScope, SaveRequest, TierContext

logger = logging.getLogger("ckpt.manager")  # the manager's messages: one logger to filter


class DurableTier:
    """The checkpoint root: durable saves, and its newest committed checkpoint on resume."""

    name = "durable"
    strict = True

    def __init__(self, saves: DurableSaves, *, policy: SaveDecisionPolicy, async_save: bool):
        self.root = saves.root
        self.policy = policy
        self.async_save = async_save
        self.timings: dict[str, float] = {}
        self._saves = saves

    # -- save ------------------------------------------------------------------------------

    def save(self, request: SaveRequest) -> str | None:
        """Save the step (periodic saves in the background with ``async_save``; ``final``
        synchronous, so the run ends on a commit), then the failure stop (collective)."""
        blocking = request.blocking
        if blocking is None:
            blocking = request.final or not self.async_save
        step = request.step
        url = self._saves.run(
            step, blocking=blocking, emergency=request.emergency, captured=request.taken
        )
        if not request.emergency:
            self._saves.failures.stop_if_failing(step, self._saves.last_committed_step)
        if request.final and url is None:
            raise self._saves.failures.final_failed(step)
        return url

    # -- load ------------------------------------------------------------------------------

    def candidates(self, scope: ResumeScope) -> list[Candidate]:
        head = scope.head
        if head is None:
            return []
        return [Candidate(head.step, head.world_size, head.record, url=self.root)]

    def load(
        self, cand: Candidate, template: dict[str, Any], want_rng: bool, scope: ResumeScope
    ) -> tuple[LoadResult | None, bool]:
        try:
            return self._load(template, scope), want_rng
        except StateMismatchError as exc:
            if not want_rng:
                raise
            # A fallback landed on a checkpoint of another world size (no RNG key for us).
            logger.warning(
                "rank %d: retrying the load without RNG state: %s", self._saves.rank, exc
            )
            template.pop(RNG_STATE_KEY)
            return self._load(template, scope), False

    def _load(self, template: dict[str, Any], scope: ResumeScope) -> LoadResult | None:
        return load_in(
            self._saves.session.emitting(self._saves.sink()),
            template,
            self.root,
            missing_ok=True,
            catalog=scope.catalog,
        )

    def url(self, result: LoadResult) -> str:
        return result.url

    def resumed(self, cand: Candidate) -> None:
        pass

    def save_in_flight(self) -> bool:
        """A save of this tier is still being written (what a clock policy waits for)."""
        pending = self._saves.session.saver.pending
        return pending is not None and not pending.done()

    def exhausted(self) -> None:
        pass

    # -- lifetime --------------------------------------------------------------------------

    def close(self, durable_step: int | None, timeout: float | None) -> None:
        """Wait for the background save in flight (its outcome counts) and free the staging
        buffers; raises ``CheckpointError`` when that wait fails."""
        self._saves.collect(timeout)
        self._saves.session.saver.close(timeout)


def build_durable_tier(ctx: TierContext) -> DurableTier:
    """The durable tier of a manager: saves every ``options.every`` steps and at ``final``."""
    return DurableTier(
        ctx.saves, policy=ctx.options.durable_policy(), async_save=ctx.options.async_save
    )
