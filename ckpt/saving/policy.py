"""When a tier saves: one save-decision policy object per tier, asked at every step.

:meth:`CheckpointManager.maybe_save <ckpt.manager.CheckpointManager.maybe_save>` asks
each tier's policy whether ``step`` is due; the policy is the only place that answers
(Orbax's ``save_decision_policy``: a protocol and small frozen policies). The durable
tier's is ``EveryNSteps(every)``, which also saves the ``final`` step so a run ends on a
commit; the memory tier's is ``EveryNSteps(memory_every, at_final=False)``: the final
step is saved durably, and a snapshot of it would only be removed again at close.

An emergency save (a termination signal) is not a policy's decision: the manager makes
it directly on the durable tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@runtime_checkable
class SaveDecisionPolicy(Protocol):
    """Whether a tier saves at ``step``; ``final``: the run's last step (every rank alike)."""

    def should_save(self, step: int, *, final: bool) -> bool: ...


@dataclass(frozen=True, slots=True)
class EveryNSteps:
    """Due at every multiple of ``every`` (0: never periodically) and, with ``at_final``,
    at the final step whatever its number."""

    every: int
    at_final: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"every={self.every!r}: must be an int >= 0 (0: not periodically)")

    def should_save(self, step: int, *, final: bool) -> bool:
        if final:
            return self.at_final
        return bool(self.every) and step % self.every == 0
