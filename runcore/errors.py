"""The mark of an error that a restart cannot fix.

A *deterministic* error is one the same code reproduces at the same point on every
attempt: a model whose shapes differ from its checkpoint, a loop that never advances
its data position, a sampler built for another dataset. Restarting the group (torchrun
``--max_restarts``) only repeats it, each time after a full start-up. ``ckpt`` and
``elastic`` mark such exceptions with :class:`DeterministicError` (a mixin next to their
own base classes), and ``elastic.RunGuard`` records them and ends a job's remaining
attempts at start-up when the next attempt hits the same one at the same point
(``elastic.repeats``).
"""

from __future__ import annotations


class DeterministicError(Exception):
    """Mixin for exceptions a restart reproduces (same code, same checkpoint, same point)."""


def is_deterministic(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a :class:`DeterministicError`."""
    seen = 0
    while exc is not None and seen < 8:  # a cause chain is short; never loop on a cycle
        if isinstance(exc, DeterministicError):
            return True
        exc = exc.__cause__
        seen += 1
    return False
