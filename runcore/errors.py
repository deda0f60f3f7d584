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


class JobEndingError(DeterministicError):
    """Mixin for deterministic errors where a restart must not even try again: a root that
    is not usable, another job's root (a retry would adopt it once that job ends), a
    configuration that does not parse. The first occurrence ends the job's remaining
    attempts at start-up (``elastic.repeats``)."""


def _in_chain(exc: BaseException | None, kind: type[BaseException]) -> bool:
    seen = 0
    while exc is not None and seen < 8:  # a cause chain is short; never loop on a cycle
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__
        seen += 1
    return False


def ends_the_job(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a :class:`JobEndingError`."""
    return _in_chain(exc, JobEndingError)


def is_deterministic(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a :class:`DeterministicError`."""
    return _in_chain(exc, DeterministicError)
