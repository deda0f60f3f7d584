"""When a tier saves: one save-decision policy object per tier, asked at every step.

:meth:`CheckpointManager.maybe_save <ckpt.manager.CheckpointManager.maybe_save>` asks
each tier's policy whether ``step`` is due, with a :class:`SaveContext` (the tier's last
save: step and time; whether a save is in flight; the time now); the policy is the only
place that answers (Orbax's ``save_decision_policy``: a protocol and small frozen
policies). The durable tier's default is ``EveryNSteps(every)``, which also saves the
``final`` step so a run ends on a commit; with ``every_s`` it is ``AnyOf(EveryNSteps(every),
EverySeconds(every_s))``; ``CheckpointOptions(policy=...)`` replaces it. The memory
tier's is ``EveryNSteps(memory_every, at_final=False)``: the final step is saved
durably, and a snapshot of it would only be removed again at close.

A decision that reads the clock (``uses_clock``) could differ between ranks, whose
clocks and step times differ: the manager takes rank 0's answer and broadcasts it (one
small collective per step, only while such a policy is in use), so every rank saves at
the same steps.

An emergency save (a termination signal) is not a policy's decision: the manager makes
it directly on the durable tier.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class SaveContext:
    """What a policy may look at besides the step (the same on every rank for a decision
    that is broadcast)."""

    now: float
    """Seconds (``time.monotonic()`` of the deciding rank)."""
    last_save_step: int | None = None
    """The step of this tier's last save in this process (None: none yet)."""
    last_save_time: float | None = None
    """When that save was decided (same clock as ``now``); None: none yet."""
    started: float = 0.0
    """When the manager was built (same clock): the interval's origin before any save."""
    in_flight: bool = False
    """A save of this tier is still being written (an async save)."""


@runtime_checkable
class SaveDecisionPolicy(Protocol):
    """Whether a tier saves at ``step``; ``final``: the run's last step (every rank alike).

    ``context`` is None when a caller has none (then a policy decides from the step)."""

    def should_save(
        self, step: int, *, final: bool, context: SaveContext | None = None
    ) -> bool: ...


def uses_clock(policy: object) -> bool:
    """Whether ``policy``'s answer depends on time (its ``uses_clock`` attribute)."""
    return bool(getattr(policy, "uses_clock", False))


@dataclass(frozen=True, slots=True)
class EveryNSteps:
    """Due at every multiple of ``every`` (0: never periodically) and, with ``at_final``,
    at the final step whatever its number."""

    every: int
    at_final: bool = True
    uses_clock = False

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"every={self.every!r}: must be an int >= 0 (0: not periodically)")

    def should_save(self, step: int, *, final: bool, context: SaveContext | None = None) -> bool:
        if final:
            return self.at_final
        return bool(self.every) and step % self.every == 0


@dataclass(frozen=True, slots=True)
class EverySeconds:
    """Due once ``seconds`` have passed since this tier's last save (since the manager was
    built, before the first), and at the final step with ``at_final``. Not while a save
    of the tier is still in flight: the next step asks again."""

    seconds: float
    at_final: bool = True
    uses_clock = True

    def __post_init__(self) -> None:
        if (
            isinstance(self.seconds, bool)
            or not isinstance(self.seconds, int | float)
            or not math.isfinite(self.seconds)
            or self.seconds <= 0
        ):
            raise ValueError(f"seconds={self.seconds!r}: must be a number of seconds > 0")

    def should_save(self, step: int, *, final: bool, context: SaveContext | None = None) -> bool:
        if final:
            return self.at_final
        if context is None or context.in_flight:
            return False
        since = context.last_save_time if context.last_save_time is not None else context.started
        return context.now - since >= self.seconds


@dataclass(frozen=True, slots=True)
class AnyOf:
    """Due when any of ``policies`` is (steps or seconds, whichever comes first)."""

    policies: Sequence[SaveDecisionPolicy]

    @property
    def uses_clock(self) -> bool:
        return any(uses_clock(p) for p in self.policies)

    def should_save(self, step: int, *, final: bool, context: SaveContext | None = None) -> bool:
        return any(p.should_save(step, final=final, context=context) for p in self.policies)
