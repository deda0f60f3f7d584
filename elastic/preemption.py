"""SIGTERM (preemption) handling: note the signal, then decide at a step boundary.

The signal handler only records when the signal arrived and sets a flag; the training
loop polls `PreemptionHandler.requested` between steps and asks `decide` whether an
emergency checkpoint fits in the time left before the SIGKILL, or whether to exit
at once and resume from the last committed checkpoint (a save cut off by SIGKILL is
harmless, since only the COMPLETE marker commits, but it wastes the grace period).

How long torchrun waits between SIGTERM and SIGKILL (torch 2.13, read in the installed
sources under torch/distributed):

- Agent gets SIGTERM (node drain, `kill <agent>`, scheduler preemption): the agent's
  handler `_terminate_process_handler` (elastic/multiprocessing/api.py, registered in
  `PContext.start` for TORCHELASTIC_SIGNALS_TO_HANDLE, default
  SIGTERM,SIGINT,SIGHUP,SIGQUIT) raises `SignalException`;
  `SimpleElasticAgent.run` (elastic/agent/server/api.py) catches it and calls
  `self._shutdown(e.sigval, timeout=self._shutdown_timeout)`, i.e.
  `LocalElasticAgent._shutdown` -> `PContext.close` -> `SubprocessContext._close`
  (elastic/multiprocessing/api.py). That sends the *same* signal the agent got (so a
  worker may see SIGINT/SIGHUP/SIGQUIT, not only SIGTERM) to each worker's process
  group (`SubprocessHandler.close`, `os.killpg`), waits until one shared deadline
  `timeout` seconds later for all local workers, then SIGKILLs the survivors.
  The timeout is torchrun's `--shutdown-timeout` (run.py), else the env
  `PET_SHUTDOWN_TIMEOUT` (argparse_util.py `env` action), else
  `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` (`LaunchConfig.__post_init__` in launcher/api.py),
  else 30 s.
- Worker-group restart (a peer failed, or a node joined): `_restart_workers` calls
  `LocalElasticAgent._stop_workers`, which calls `self._shutdown()` with its defaults:
  SIGTERM and a hard-coded 30 s, whatever `--shutdown-timeout` says. The same path
  runs when restarts are exhausted (`_invoke_run` -> `_stop_workers`).

So the default grace is 30 s. A worker cannot see `--shutdown-timeout` given on the
command line, only the environment variables; set `TRAINER_PREEMPTION_GRACE_S` (or
pass `grace_s`) when the launcher or the scheduler (e.g. Kubernetes
terminationGracePeriodSeconds, SLURM KillWait) gives a different budget. Precedence:
the `grace_s` argument, then TRAINER_PREEMPTION_GRACE_S, PET_SHUTDOWN_TIMEOUT,
TORCH_ELASTIC_SHUTDOWN_TIMEOUT, then 30 s.

A SIGTERM may reach only some ranks (one node is drained, the others keep running):
ranks must agree before acting, or one rank enters the save's collectives while
another exits. `agree_on_preemption` does that with one small all_reduce.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from elastic.errors import PreemptionHandlerError

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

ENV_GRACE_S = "TRAINER_PREEMPTION_GRACE_S"
ENV_TORCHRUN_SHUTDOWN_TIMEOUT = "PET_SHUTDOWN_TIMEOUT"
ENV_TORCHELASTIC_SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
GRACE_ENV_PRECEDENCE: tuple[str, ...] = (
    ENV_GRACE_S,
    ENV_TORCHRUN_SHUTDOWN_TIMEOUT,
    ENV_TORCHELASTIC_SHUTDOWN_TIMEOUT,
)
DEFAULT_GRACE_S = 30.0
"""torchrun's default wait between the termination signal and SIGKILL."""
DEFAULT_SAFETY_FACTOR = 1.5


@dataclass(frozen=True, slots=True, kw_only=True)
class PreemptionDecision:
    """What to do after a termination signal, decided at a step boundary."""

    save: bool
    """True: write an emergency checkpoint, then exit. False: exit now."""
    remaining_s: float
    """Seconds of grace left when deciding (negative when already past it)."""
    needed_s: float | None
    """expected_save_s * safety_factor, or None when no save estimate exists."""
    reason: str
    """One line for the event log."""


def decide_emergency_save(
    signal_time: float,
    now: float,
    grace_s: float,
    expected_save_s: float | None,
    safety_factor: float = DEFAULT_SAFETY_FACTOR,
) -> PreemptionDecision:
    """Decide whether an emergency checkpoint fits in the grace left after a signal.

    Pure. `signal_time` and `now` are on the same clock (seconds). The save is done
    when `expected_save_s * safety_factor` fits in `grace_s - (now - signal_time)`.
    With no estimate (`expected_save_s` None: no save has been timed yet in this
    process) it does not save and relies on the last committed checkpoint.
    """
    if not math.isfinite(grace_s) or grace_s < 0:
        raise ValueError(f"grace_s must be a finite number >= 0, got {grace_s}")
    if not math.isfinite(safety_factor) or safety_factor < 1.0:
        raise ValueError(f"safety_factor must be a finite number >= 1, got {safety_factor}")
    if expected_save_s is not None and (not math.isfinite(expected_save_s) or expected_save_s < 0):
        raise ValueError(f"expected_save_s must be a finite number >= 0, got {expected_save_s}")
    remaining = grace_s - max(0.0, now - signal_time)
    if expected_save_s is None:
        return PreemptionDecision(
            save=False,
            remaining_s=remaining,
            needed_s=None,
            reason="no save duration known yet; exiting on the last committed checkpoint",
        )
    needed = expected_save_s * safety_factor
    if needed <= remaining:
        return PreemptionDecision(
            save=True,
            remaining_s=remaining,
            needed_s=needed,
            reason=f"emergency save needs {needed:.1f}s of {remaining:.1f}s left",
        )
    return PreemptionDecision(
        save=False,
        remaining_s=remaining,
        needed_s=needed,
        reason=(
            f"emergency save needs {needed:.1f}s but only {remaining:.1f}s left; "
            "exiting on the last committed checkpoint"
        ),
    )


def grace_from_env(env: Mapping[str, str] | None = None) -> float:
    """Return the grace period in seconds from the environment (see module doc).

    Looks at TRAINER_PREEMPTION_GRACE_S, PET_SHUTDOWN_TIMEOUT and
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT in that order; 30 s when none is set.
    """
    source: Mapping[str, str] = os.environ if env is None else env
    for name in GRACE_ENV_PRECEDENCE:
        raw = source.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(
                f"environment variable {name}={raw!r} is not a number of seconds"
            ) from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"environment variable {name}={raw!r} must be >= 0 seconds")
        return value
    return DEFAULT_GRACE_S


def combine_preemption_votes(requested: int, cannot_save: int) -> tuple[bool, bool]:
    """Turn the all-rank maxima of (requested, cannot_save) into (stop, save).

    Pure. Stop when any rank was signalled; save only when no signalled rank found
    the save too slow for its remaining grace.
    """
    stop = requested > 0
    return stop, stop and cannot_save == 0


def agree_on_preemption(
    decision: PreemptionDecision | None,
    process_group: dist.ProcessGroup | None = None,
) -> PreemptionDecision | None:
    """Make every rank take the same preemption action.

    Collective: every rank of the group (default group when None) calls it at the
    same step boundary, passing its local decision (`handler.decide(...)`) or None
    when it was not signalled. Returns None when no rank was signalled; otherwise the
    same save/exit choice on every rank: save only if every signalled rank can.
    Without a process group it returns `decision` unchanged.
    """
    # Imported here: the signal handling needs no torch, only the agreement does.
    from elastic.collectives import all_reduce_max_ints

    requested = 0 if decision is None else 1
    cannot_save = 1 if decision is not None and not decision.save else 0
    max_requested, max_cannot = all_reduce_max_ints([requested, cannot_save], process_group)
    stop, save = combine_preemption_votes(max_requested, max_cannot)
    if not stop:
        return None
    if decision is not None and decision.save == save:
        return decision
    reason = (
        "another rank was signalled; following it"
        if decision is None
        else "another signalled rank cannot fit an emergency save"
    )
    return PreemptionDecision(
        save=save,
        remaining_s=math.inf if decision is None else decision.remaining_s,
        needed_s=None if decision is None else decision.needed_s,
        reason=reason,
    )


class PreemptionHandler:
    """Catches SIGTERM (and optionally SIGINT, ...) and records when it arrived.

    Every rank creates one in its main thread at startup and closes it at exit
    (restoring the previous handlers). The handler itself only stores the time and
    the signal number; the loop polls `requested` between steps, then calls
    `decide(expected_save_s)` and `agree_on_preemption`.
    """

    def __init__(
        self,
        grace_s: float | None = None,
        *,
        signals: Iterable[signal.Signals] = (signal.SIGTERM,),
        safety_factor: float = DEFAULT_SAFETY_FACTOR,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise PreemptionHandlerError(
                "PreemptionHandler must be created in the main thread "
                f"(Python only runs signal handlers there); called from "
                f"{threading.current_thread().name!r}"
            )
        self.grace_s = grace_from_env(env) if grace_s is None else float(grace_s)
        if not math.isfinite(self.grace_s) or self.grace_s < 0:
            raise ValueError(f"grace_s must be a finite number >= 0, got {grace_s}")
        if safety_factor < 1.0:
            raise ValueError(f"safety_factor must be >= 1, got {safety_factor}")
        self.safety_factor = safety_factor
        self.signal_time: float | None = None
        """time.monotonic() when the first signal arrived."""
        self.signal_number: int | None = None
        self._previous: dict[signal.Signals, Any] = {}
        try:
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        except (OSError, ValueError) as exc:
            self.close()
            raise PreemptionHandlerError(f"cannot install a handler for {sig!r}: {exc}") from exc

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs between bytecodes in the main thread: record and return, nothing else.
        if self.signal_time is None:
            self.signal_time = time.monotonic()
            self.signal_number = signum

    @property
    def requested(self) -> bool:
        """True once a handled signal has arrived."""
        return self.signal_time is not None

    @property
    def signal_name(self) -> str | None:
        """Name of the signal received (e.g. "SIGTERM"), None before one arrives."""
        if self.signal_number is None:
            return None
        return signal.Signals(self.signal_number).name

    def decide(self, expected_save_s: float | None, now: float | None = None) -> PreemptionDecision:
        """Decide between an emergency save and an immediate exit (local, pure logic).

        `expected_save_s` is the duration of a recent save on this rank (None if
        none yet); `now` defaults to time.monotonic(). Raises PreemptionHandlerError
        when no signal has arrived.
        """
        if self.signal_time is None:
            raise PreemptionHandlerError("decide() called but no termination signal arrived")
        return decide_emergency_save(
            self.signal_time,
            time.monotonic() if now is None else now,
            self.grace_s,
            expected_save_s,
            self.safety_factor,
        )

    def close(self) -> None:
        """Restore the handlers that were installed before; call from the main thread."""
        if threading.current_thread() is not threading.main_thread():
            raise PreemptionHandlerError("PreemptionHandler.close must run in the main thread")
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> PreemptionHandler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
