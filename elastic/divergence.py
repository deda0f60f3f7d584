"""What a run does when its loss stops being finite: stop, or roll back and skip data.

Large runs diverge (a loss spike that ends in NaN, a bad batch, a learning rate too high).
Training on is useless and, with retention, destroys the last sound checkpoints; the fixes
used at scale (OPT, MegaScale) are to stop at the last healthy checkpoint, or to restore it
and skip the data that led to the divergence. ``RunGuard.check(loss)`` applies a
:class:`DivergencePolicy`:

- ``stop`` (default): every rank raises :class:`~elastic.errors.Diverged` (exit code 3),
  saying the step, the last checkpoint and how to resume;
- ``rollback``: every rank restores the newest committed checkpoint (the checkpoint
  library never commits a non-finite state, so it is finite), skips the next ``skip``
  global batches through the sampler (``"auto"``: as many as were trained since that
  checkpoint, the diverged step's included) and trains on; at most ``max_rollbacks``
  times per process, then it stops.

The decisions here are pure (table-tested); the guard does the collectives and the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

STOP = "stop"
ROLLBACK = "rollback"
ACTIONS = (STOP, ROLLBACK)
AUTO = "auto"


@dataclass(frozen=True, slots=True, kw_only=True)
class DivergencePolicy:
    """What :meth:`elastic.RunGuard.check` does with a non-finite loss."""

    action: str = STOP
    """``"stop"`` or ``"rollback"``."""
    skip: int | None = None
    """Global batches to skip after the restored step; None (``"auto"``): the batches
    trained since it, the diverged step's included."""
    max_rollbacks: int = 3
    """Roll back at most this many times per process; the next divergence stops."""

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"divergence must be one of {', '.join(ACTIONS)}, got {self.action!r}")
        if self.skip is not None and (
            isinstance(self.skip, bool) or not isinstance(self.skip, int) or self.skip < 0
        ):
            raise ValueError(f"rollback_skip must be 'auto' or an int >= 0, got {self.skip!r}")
        if (
            isinstance(self.max_rollbacks, bool)
            or not isinstance(self.max_rollbacks, int)
            or self.max_rollbacks < 0
        ):
            raise ValueError(f"max_rollbacks must be an int >= 0, got {self.max_rollbacks!r}")

    @classmethod
    def of(cls, action: str, skip: int | str = AUTO, max_rollbacks: int = 3) -> DivergencePolicy:
        """From the guard's arguments (``skip`` may be ``"auto"``)."""
        if isinstance(skip, str):
            if skip.strip().lower() != AUTO:
                raise ValueError(f"rollback_skip must be 'auto' or an int >= 0, got {skip!r}")
            return cls(action=action, skip=None, max_rollbacks=max_rollbacks)
        return cls(action=action, skip=skip, max_rollbacks=max_rollbacks)


def decide(policy: DivergencePolicy, rollbacks_done: int, last_step: int | None) -> tuple[str, str]:
    """``(action, why)`` for a divergence; ``last_step`` is the newest checkpoint (None:
    none). Pure."""
    if policy.action == STOP:
        return STOP, "the divergence policy is stop"
    if last_step is None:
        return STOP, "no checkpoint to roll back to"
    if rollbacks_done >= policy.max_rollbacks:
        return STOP, f"already rolled back {rollbacks_done} time(s) (max_rollbacks)"
    return ROLLBACK, f"rollback {rollbacks_done + 1} of at most {policy.max_rollbacks}"


def batches_to_skip(policy: DivergencePolicy, diverged_step: int, restored_step: int) -> int:
    """Global batches to skip after restoring ``restored_step``. Pure."""
    if policy.skip is not None:
        return policy.skip
    return max(1, diverged_step - restored_step)
