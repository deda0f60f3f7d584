"""Every exception ``elastic`` raises on purpose, in one place (standard library only).

- :class:`Preempted`: a termination signal stopped training at a step boundary; a
  ``SystemExit`` whose code is ``128 + signal`` (143 for SIGTERM).
- :class:`PreemptionHandlerError`: the preemption handler cannot be installed or used.
- :class:`MicroBatchSplitError` (a ``ValueError``): the per-rank batch cannot be cut into
  micro-batches of the asked size.
- :class:`SamplerStateError` (a ``ValueError``): an ``ElasticSampler`` used or restored in
  a way that would skip or repeat samples (another order, an epoch the cursor is not in).
- :class:`InjectedFault`: a ``raise`` fault of the fault plan (``elastic.faults``) fired.
- :class:`RepeatedErrorStop`: a job whose deterministic error repeated ends its remaining
  attempts at start-up (``elastic.repeats``).

- :class:`Diverged`: the loss was not finite and the divergence policy stops the run; a
  ``SystemExit`` with code :data:`DIVERGED_EXIT_CODE`.

``MicroBatchSplitError`` and ``SamplerStateError`` are deterministic
(``runcore.errors.DeterministicError``): a restart reproduces them.
"""

from __future__ import annotations

import signal
from typing import Any

from runcore.errors import DeterministicError


class Preempted(SystemExit):
    """A termination signal stopped training at a step boundary (after any emergency save).

    A ``SystemExit``: uncaught, the process exits with ``128 + signal`` (143 for
    SIGTERM), after ``with`` blocks (the checkpoint manager's close) have run.
    """

    def __init__(self, step: int, signal_name: str, saved: bool) -> None:
        super().__init__(128 + int(getattr(signal, signal_name, signal.SIGTERM)))
        self.step = step
        self.signal_name = signal_name
        self.saved = saved

    @property
    def exit_code(self) -> int:
        return int(self.code)  # type: ignore[arg-type]

    def __str__(self) -> str:
        how = (
            " (emergency checkpoint saved)" if self.saved else " (resume from the last checkpoint)"
        )
        return f"stopped by {self.signal_name} after step {self.step}{how}"


DIVERGED_EXIT_CODE = 3
"""Exit code of a run stopped because its loss was not finite (``Diverged``)."""


class Diverged(SystemExit):
    """The loss was not finite (NaN or inf) and the divergence policy stops the run.

    A ``SystemExit`` (code :data:`DIVERGED_EXIT_CODE`): uncaught, the process exits after
    ``with`` blocks (the checkpoint manager's close) have run. ``str()`` says the step, the
    last checkpoint (every committed checkpoint is finite: the save refuses NaN) and how to
    resume.
    """

    def __init__(self, step: int, message: str, last_checkpoint_step: int | None) -> None:
        super().__init__(DIVERGED_EXIT_CODE)
        self.step = step
        self.message = message
        self.last_checkpoint_step = last_checkpoint_step

    @property
    def exit_code(self) -> int:
        return DIVERGED_EXIT_CODE

    def __str__(self) -> str:
        return self.message


class PreemptionHandlerError(RuntimeError):
    """The preemption handler cannot be installed or used as asked."""


class MicroBatchSplitError(ValueError, DeterministicError):
    """The per-rank batch cannot be cut into micro-batches of the requested size."""


class SamplerStateError(ValueError, DeterministicError):
    """An ``ElasticSampler`` restored or used in a way that would skip or repeat samples."""


class RepeatedErrorStop(SystemExit):
    """This job's deterministic error repeated at the same point: this attempt ends at once.

    A ``SystemExit`` with code 1, raised at start-up (``elastic.init_distributed``,
    ``RunGuard``) by every later attempt of the same torchrun job, so torchrun's
    remaining restarts end in seconds instead of each repeating the error.
    """

    def __init__(self, message: str) -> None:
        super().__init__(1)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` fault (``elastic.faults``); an intentional failure, never a bug."""

    def __init__(self, spec: Any, step: int, rank: int) -> None:
        super().__init__(f"injected fault {spec} fired at step {step} on rank {rank}")
        self.spec = spec
        """The ``elastic.faults.FaultSpec`` that fired."""
        self.step = step
        self.rank = rank
