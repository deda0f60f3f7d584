"""Asking the tiers' save-decision policies at a step, with their context, in agreement.

One object per manager. It keeps, per tier, the step and time of the last save its
policy decided, builds the :class:`~ckpt.saving.policy.SaveContext` a policy is asked
with, and, for a policy that reads the clock, takes rank 0's answer to every rank (one
broadcast of a bool through the checkpoint group), so that no two ranks ever disagree on
whether a step saves. A policy written against the old protocol
(``should_save(step, *, final)``) is asked without a context.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

from ckpt import dist as _dist
from ckpt.saving.policy import SaveContext, uses_clock


def _takes_context(policy: Any) -> bool:
    try:
        params = inspect.signature(policy.should_save).parameters
    except (TypeError, ValueError):
        return False
    return "context" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class SaveDecisions:
    """Whether each tier saves at a step (collective when a policy reads the clock)."""

    def __init__(self, group: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._coll = _dist.Collective(group)
        self._clock = clock
        self._started = clock()
        self._last: dict[int, tuple[int, float]] = {}
        self._with_context: dict[int, bool] = {}

    def context(self, tier: Any) -> SaveContext:
        last = self._last.get(id(tier))
        in_flight = getattr(tier, "save_in_flight", None)
        return SaveContext(
            now=self._clock(),
            last_save_step=None if last is None else last[0],
            last_save_time=None if last is None else last[1],
            started=self._started,
            in_flight=bool(in_flight()) if callable(in_flight) else False,
        )

    def _ask(self, tier: Any, step: int, final: bool, context: SaveContext) -> bool:
        policy = tier.policy
        key = id(tier)
        if key not in self._with_context:
            self._with_context[key] = _takes_context(policy)
        if self._with_context[key]:
            return bool(policy.should_save(step, final=final, context=context))
        return bool(policy.should_save(step, final=final))

    def peek(self, tier: Any, step: int) -> bool:
        """What ``tier``'s policy would say of a non-final ``step`` now, on this rank's
        clock: no collective, nothing recorded."""
        return self._ask(tier, step, False, self.context(tier))

    def due(self, tier: Any, step: int, *, final: bool) -> bool:
        """Ask ``tier.policy`` about ``step``; a clock policy's answer is rank 0's."""
        policy = tier.policy
        key = id(tier)
        context = self.context(tier)
        decision = self._ask(tier, step, final, context)
        if uses_clock(policy):
            decision = bool(self._coll.broadcast(decision))
        if decision:
            self._last[key] = (step, context.now)
        return decision
