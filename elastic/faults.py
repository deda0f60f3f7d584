"""Fault injection at a given (step, rank, attempt), for testing recovery for real.

Grammar (docs/design.md): `KIND:step=S[:rank=R][:attempt=A]`, or
`KIND:at=POINT[:rank=R][:attempt=A]` for a point of the start-up, from repeatable
`--fault` arguments and from the environment variable `TRAINER_FAULTS`
(`;`-separated). Command-line specs come first, then the environment's; both apply.
It is the one key=value grammar of every fault in this project
(`runcore.faultspec.split_fault_spec`): `ckpt.storage.faults` parses `CKPT_STORAGE_FAULTS` with it too, and a `ckpt-storage` spec takes
the storage keys `phase`, `error`, `times` and `delay_ms` besides step, rank and attempt.

Kinds:

- `kill`: SIGKILL to itself (no cleanup, no flushing beyond the log flush before it).
- `exit`: exit code 1 through `os._exit(1)` after flushing logs (skips atexit and
  finally blocks, like a crash in native code that still reports an error code).
- `raise`: raise `InjectedFault` from the training loop.
- `hang`: stop making progress forever, sleeping so the GIL stays free for the
  watchdog thread (which is what should notice it).
- `sigterm`: SIGTERM to itself, as a preemption would deliver it.
- `stall`: hold the GIL for `seconds=N` (default 10) and go on, as a full garbage
  collection of a large heap or a C call that keeps the GIL does: every thread of the
  process stops (the heartbeat's too) while the process lives.
- `ckpt-storage`: the next checkpoint's writes on that rank fail (by default the first
  shard write, with a permanent error: `phase=shard:error=permanent:times=1`); the plan
  only reports it (`FaultPlan.storage_fault_due`), and `RunGuard` arms it in the
  checkpoint manager (`inject_storage_fault(spec.storage_spec())`).
- `nan`: a divergence: at the start of step S, that rank's parameters become NaN (so the
  step's loss is NaN on every rank, and so are the parameters after it); the plan only
  reports it (`FaultPlan.nan_faults_due`), and `RunGuard` has the checkpoint manager fill
  them (`inject_non_finite()`).

Each kind has exactly one handler: a process action in :data:`PROCESS_ACTIONS` (the plan
carries it out, :meth:`FaultPlan.fire`) or a saver action in :data:`SAVER_ACTIONS` (the plan
only reports it, :meth:`FaultPlan.saver_faults_due`, and ``RunGuard`` calls the action with
its checkpoint manager); :func:`unhandled_kinds` names any kind left out, and firing one is
an error, never a silent no-op.

`rank` omitted means every rank. A fault fires only in the attempt whose job-wide
restart count equals `attempt` (default 0), so a restarted job does not fail again at
the same step.

Start-up points (`at=POINT`, :data:`START_POINTS`; any kind but `ckpt-storage`), fired by
:func:`fire_at_point` where the start-up reaches them, before any step:

- `init_process_group`: in `elastic.init_distributed`, just before the process group is
  built (its peers then wait for this rank in theirs). The attempt is this agent's
  restart count (`TORCHELASTIC_RESTART_COUNT`): the job-wide one needs the group.
- `checkpoint_manager`: the trainer, just before it builds its `ckpt.CheckpointManager`
  (whose construction builds the checkpoint group, a collective).
- `resume`: the trainer, just before `CheckpointManager.resume()`.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastic.errors import InjectedFault
from runcore.faultspec import split_fault_spec

logger = logging.getLogger(__name__)

ENV_FAULTS = "TRAINER_FAULTS"
"""Environment variable with `;`-separated fault specs, applied after `--fault` ones."""

ENV_SEPARATOR = ";"

SPEC_GRAMMAR = "KIND:step=S[:rank=R][:attempt=A] or KIND:at=POINT[:rank=R][:attempt=A]"


class FaultKind(str, enum.Enum):
    """What an injected fault does to the process."""

    KILL = "kill"
    EXIT = "exit"
    RAISE = "raise"
    HANG = "hang"
    SIGTERM = "sigterm"
    STALL = "stall"
    CKPT_STORAGE = "ckpt-storage"
    NAN = "nan"


VALID_KINDS: tuple[str, ...] = tuple(kind.value for kind in FaultKind)
VALID_KEYS: tuple[str, ...] = ("step", "at", "rank", "attempt")
START_POINTS: tuple[str, ...] = ("init_process_group", "checkpoint_manager", "resume")
"""Points of the start-up a fault can be placed at (``at=POINT``), in the order a start-up
reaches them."""
STORAGE_KEYS: tuple[str, ...] = ("phase", "error", "times", "delay_ms")
"""Extra keys of a `ckpt-storage` spec, handed to the checkpoint library as they are."""
STALL_KEYS: tuple[str, ...] = ("seconds",)
"""Extra key of a `stall` spec: how long the GIL is held (whole seconds, default 10)."""
DEFAULT_STALL_S = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultSpec:
    """One parsed fault: what to do, at which step, on which rank, in which attempt."""

    kind: FaultKind
    step: int | None = None
    """Optimizer step at which it fires (ckpt-storage: first save at or after it); None for
    a fault at a start-up point."""
    at: str | None = None
    """The start-up point it fires at (one of :data:`START_POINTS`), instead of a step."""
    rank: int | None = None
    """Global rank it fires on; None means every rank."""
    attempt: int = 0
    """Job-wide restart count of the attempt it fires in."""
    storage: tuple[tuple[str, str], ...] = ()
    """`ckpt-storage` only: the storage keys given (phase, error, times, delay_ms)."""
    seconds: int = DEFAULT_STALL_S
    """`stall` only: how long the GIL is held."""

    def __post_init__(self) -> None:
        if (self.step is None) == (self.at is None):
            raise ValueError(f"a fault needs a step or a start-up point (at=), not both: {self!r}")
        if self.at is not None and self.at not in START_POINTS:
            raise ValueError(f"fault at={self.at!r}: not one of {', '.join(START_POINTS)}")
        if self.at is not None and self.kind is FaultKind.CKPT_STORAGE:
            raise ValueError("a ckpt-storage fault needs a step, not a start-up point")
        for name in ("step", "attempt"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"fault {name} must be >= 0, got {value}")
        if self.rank is not None and self.rank < 0:
            raise ValueError(f"fault rank must be >= 0, got {self.rank}")

    def applies_to(self, rank: int, attempt: int) -> bool:
        """True when this fault targets `rank` in the attempt numbered `attempt`."""
        return self.attempt == attempt and (self.rank is None or self.rank == rank)

    def storage_spec(self) -> str:
        """The storage fault for `ckpt` (`ckpt-storage:phase=...`), rank and step left out:
        the plan has already decided that it applies here and now."""
        return ":".join([self.kind.value, *(f"{k}={v}" for k, v in self.storage)])

    def __str__(self) -> str:
        where = f"step={self.step}" if self.at is None else f"at={self.at}"
        text = f"{self.kind.value}:{where}"
        if self.rank is not None:
            text += f":rank={self.rank}"
        text += f":attempt={self.attempt}"
        if self.kind is FaultKind.STALL:
            text += f":seconds={self.seconds}"
        return "".join([text, *(f":{k}={v}" for k, v in self.storage)])


def _spec_error(text: str, reason: str) -> ValueError:
    return ValueError(
        f"invalid fault spec {text!r}: {reason}; expected {SPEC_GRAMMAR} with KIND one of "
        f"{', '.join(VALID_KINDS)} and keys {', '.join(VALID_KEYS)} (non-negative integers)"
    )


def parse_fault_spec(text: str) -> FaultSpec:
    """Parse one `KIND:step=S[:rank=R][:attempt=A]` spec (`ckpt-storage` also takes
    `phase=P`, `error=E`, `times=N`, `delay_ms=M`, checked by `ckpt` when armed).

    Raises ValueError naming the spec and listing the valid kinds and keys when the
    text does not follow the grammar. Pure; any rank may call it.
    """
    try:
        kind_text, fields = split_fault_spec(text)
    except ValueError as exc:
        raise _spec_error(text, str(exc)) from None
    try:
        kind = FaultKind(kind_text)
    except ValueError:
        raise _spec_error(text, f"unknown kind {kind_text!r}") from None
    allowed = VALID_KEYS + (STORAGE_KEYS if kind is FaultKind.CKPT_STORAGE else ())
    allowed += STALL_KEYS if kind is FaultKind.STALL else ()
    values: dict[str, int] = {}
    storage: list[tuple[str, str]] = []
    at: str | None = None
    for key, raw in fields.items():
        if key not in allowed:
            raise _spec_error(text, f"unknown key {key!r}")
        if key == "at":
            if raw not in START_POINTS:
                raise _spec_error(text, f"at={raw!r} is not one of {', '.join(START_POINTS)}")
            at = raw
            continue
        if key in STORAGE_KEYS:
            if not raw:
                raise _spec_error(text, f"{key}= needs a value")
            storage.append((key, raw))
            continue
        if not (raw.isascii() and raw.isdigit()):
            raise _spec_error(text, f"{key}={raw!r} is not a non-negative integer")
        values[key] = int(raw)
    if ("step" in values) == (at is not None):
        raise _spec_error(text, "step is required (or at=POINT instead, for a start-up point)")
    if at is not None and kind is FaultKind.CKPT_STORAGE:
        raise _spec_error(text, "ckpt-storage needs step=S, not at=POINT")
    return FaultSpec(
        kind=kind,
        step=values.get("step"),
        at=at,
        rank=values.get("rank"),
        attempt=values.get("attempt", 0),
        storage=tuple(storage),
        seconds=values.get("seconds", DEFAULT_STALL_S),
    )


def _flush_logs() -> None:
    # Handlers buffer (files, pipes); a fault that ends the process skips their flush.
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _hang_forever() -> None:
    # time.sleep releases the GIL, so the watchdog thread keeps running and can
    # notice that no step completes.
    while True:
        time.sleep(3600.0)


def _raise(spec: FaultSpec, step: int, rank: int) -> None:
    raise InjectedFault(spec, step, rank)


def _sigterm(spec: FaultSpec, step: int, rank: int) -> None:
    # Returns: a handler installed by PreemptionHandler only sets a flag.
    _flush_logs()
    os.kill(os.getpid(), signal.SIGTERM)


def _kill(spec: FaultSpec, step: int, rank: int) -> None:
    _flush_logs()
    os.kill(os.getpid(), signal.SIGKILL)
    # SIGKILL to oneself is delivered before kill() returns on Linux; this only guards
    # against a platform that delivers it late.
    time.sleep(10.0)
    os._exit(128 + signal.SIGKILL)


def _exit(spec: FaultSpec, step: int, rank: int) -> None:
    _flush_logs()
    os._exit(1)


def _hang(spec: FaultSpec, step: int, rank: int) -> None:
    _flush_logs()
    _hang_forever()


def _stall(spec: FaultSpec, step: int, rank: int) -> None:
    # A function of a ctypes.PyDLL keeps the GIL through the call (a CDLL's releases it):
    # libc's sleep() in it stops every thread of the process, as a long garbage
    # collection does, and the process stays alive and running.
    import ctypes

    _flush_logs()
    started = time.monotonic()
    left = spec.seconds
    while left > 0:  # a signal cuts sleep() short; it returns the seconds left
        left = int(ctypes.PyDLL(None).sleep(left))
    logger.warning("rank %d step %d: held the GIL for %.1fs", rank, step, time.monotonic() - started)


PROCESS_ACTIONS: Mapping[FaultKind, Callable[[FaultSpec, int, int], None]] = {
    FaultKind.RAISE: _raise,
    FaultKind.SIGTERM: _sigterm,
    FaultKind.KILL: _kill,
    FaultKind.EXIT: _exit,
    FaultKind.HANG: _hang,
    FaultKind.STALL: _stall,
}
"""What each process fault does to this process, by kind (:meth:`FaultPlan.fire`)."""


def _arm_storage_fault(saver: Any, spec: FaultSpec) -> None:
    saver.inject_storage_fault(spec.storage_spec())


def _fill_non_finite(saver: Any, spec: FaultSpec) -> None:
    saver.inject_non_finite()


SAVER_ACTIONS: Mapping[FaultKind, Callable[[Any, FaultSpec], None]] = {
    FaultKind.CKPT_STORAGE: _arm_storage_fault,
    FaultKind.NAN: _fill_non_finite,
}
"""What each saver fault asks of the checkpoint manager (``RunGuard`` calls it with its
saver, an :class:`elastic.guard.EmergencySaver`)."""

_SAVER_FAULTS = tuple(SAVER_ACTIONS)
"""Kinds the plan only reports; `RunGuard` carries them out through its saver."""


def unhandled_kinds() -> list[FaultKind]:
    """Kinds with no action in either table, or in both (empty when the tables are whole):
    such a kind would parse and then never fire."""
    return [
        kind for kind in FaultKind if (kind in PROCESS_ACTIONS) == (kind in SAVER_ACTIONS)
    ]


class FaultPlan:
    """The faults requested for this run, and which of them this process has used.

    Every rank builds the same plan from the same arguments and environment, and calls
    `fire` once per step (after the step, before the next one) and
    `storage_fault_due` before each checkpoint save. Each rank decides for itself;
    neither call is a collective.
    """

    def __init__(self, specs: Sequence[FaultSpec] = ()) -> None:
        self.specs: tuple[FaultSpec, ...] = tuple(specs)
        self._consumed: set[int] = set()

    @classmethod
    def from_args_and_env(
        cls, specs: Sequence[str], env: Mapping[str, str] | None = None
    ) -> FaultPlan:
        """Build the plan from `--fault` values, then `TRAINER_FAULTS` in `env`.

        `env` defaults to `os.environ`. Empty entries (e.g. a trailing `;`) are
        ignored. Raises ValueError on the first malformed spec.
        """
        source: Mapping[str, str] = os.environ if env is None else env
        texts = [text for text in specs if text.strip()]
        texts += [t for t in source.get(ENV_FAULTS, "").split(ENV_SEPARATOR) if t.strip()]
        return cls([parse_fault_spec(text) for text in texts])

    def __bool__(self) -> bool:
        return bool(self.specs)

    def __repr__(self) -> str:
        return f"FaultPlan([{', '.join(str(spec) for spec in self.specs)}])"

    def due(self, step: int, rank: int, attempt: int) -> list[FaultSpec]:
        """Return the unused process faults (not ckpt-storage or nan) that fire at this step."""
        return [spec for _, spec in self._due(step, rank, attempt)]

    def _due(self, step: int, rank: int, attempt: int) -> list[tuple[int, FaultSpec]]:
        return [
            (index, spec)
            for index, spec in enumerate(self.specs)
            if spec.kind not in _SAVER_FAULTS
            and index not in self._consumed
            and spec.at is None
            and spec.step == step
            and spec.applies_to(rank, attempt)
        ]

    def fire_at(
        self,
        point: str,
        rank: int,
        attempt: int,
        on_fire: Callable[[FaultSpec], None] | None = None,
    ) -> None:
        """Carry out every fault planned at the start-up point ``point`` for (rank, attempt),
        in order, once per process; as :meth:`fire` does for a step."""
        if point not in START_POINTS:
            raise ValueError(f"{point!r} is not a start-up point ({', '.join(START_POINTS)})")
        for index, spec in enumerate(self.specs):
            if index in self._consumed or spec.at != point or not spec.applies_to(rank, attempt):
                continue
            self._consumed.add(index)
            logger.warning("rank %d at %s: injecting fault %s", rank, point, spec)
            if on_fire is not None:
                on_fire(spec)
            self._act(spec, 0, rank)

    def fire(
        self,
        step: int,
        rank: int,
        attempt: int,
        on_fire: Callable[[FaultSpec], None] | None = None,
    ) -> None:
        """Carry out every process fault due at (step, rank, attempt), in order.

        `attempt` is the job-wide restart count (`job_restart_count`). `on_fire` is
        called with the spec before its action, so the trainer can record an event;
        kill, exit and hang do not return, raise raises `InjectedFault`, sigterm
        returns after signalling (a handler installed by `PreemptionHandler` only sets
        a flag). Each fault fires at most once per process.
        """
        for index, spec in self._due(step, rank, attempt):
            self._consumed.add(index)
            logger.warning("rank %d step %d: injecting fault %s", rank, step, spec)
            if on_fire is not None:
                on_fire(spec)
            self._act(spec, step, rank)

    def nan_faults_due(self, step: int, rank: int, attempt: int) -> list[FaultSpec]:
        """Consume and return the `nan` faults of this exact step, rank and attempt; the
        caller makes the state non-finite (`RunGuard`, through its saver)."""
        due = []
        for index, spec in enumerate(self.specs):
            if (
                spec.kind is FaultKind.NAN
                and index not in self._consumed
                and spec.step == step
                and spec.applies_to(rank, attempt)
            ):
                self._consumed.add(index)
                logger.warning("rank %d step %d: injecting fault %s", rank, step, spec)
                due.append(spec)
        return due

    def saver_faults_due(self, step: int, rank: int, attempt: int) -> list[FaultSpec]:
        """Consume and return every saver fault due now (:data:`SAVER_ACTIONS`):
        ckpt-storage ones whose step has been reached, then nan ones of this exact step.
        The caller carries each out with ``SAVER_ACTIONS[spec.kind](saver, spec)``."""
        return self.storage_faults_due(step, rank, attempt) + self.nan_faults_due(
            step, rank, attempt
        )

    def storage_fault_due(self, step: int, rank: int, attempt: int) -> bool:
        """Return True once for a ckpt-storage fault whose step has been reached.

        Like :meth:`storage_faults_due`, as a yes/no.
        """
        return bool(self.storage_faults_due(step, rank, attempt))

    def storage_faults_due(self, step: int, rank: int, attempt: int) -> list[FaultSpec]:
        """Consume and return the ckpt-storage faults whose step has been reached.

        A ckpt-storage spec for this rank and attempt with spec.step <= step that this
        process has not used yet is consumed and returned; the caller arms it for the
        next checkpoint save on this rank (`RunGuard` does, before each step).
        """
        due = []
        for index, spec in enumerate(self.specs):
            if (
                spec.kind is FaultKind.CKPT_STORAGE
                and index not in self._consumed
                and spec.step is not None
                and spec.step <= step
                and spec.applies_to(rank, attempt)
            ):
                self._consumed.add(index)
                logger.warning("rank %d step %d: injecting fault %s", rank, step, spec)
                due.append(spec)
        return due

    @staticmethod
    def _act(spec: FaultSpec, step: int, rank: int) -> None:
        action = PROCESS_ACTIONS.get(spec.kind)
        if action is None:
            # A saver kind reaching here would be a fault that silently never fires.
            raise ValueError(f"fault {spec}: kind {spec.kind.value!r} is not a process fault")
        action(spec, step, rank)


def fire_at_point(
    point: str,
    rank: int,
    attempt: int,
    specs: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    on_fire: Callable[[FaultSpec], None] | None = None,
) -> None:
    """Fire the faults planned at the start-up point ``point`` (``KIND:at=POINT...`` in
    ``specs``, then ``TRAINER_FAULTS``) for this rank and attempt.

    Called where the start-up reaches the point, on every rank, before a ``RunGuard``
    exists (its plan fires the step faults); see the module docstring for the points.
    """
    FaultPlan.from_args_and_env(specs, env).fire_at(point, rank, attempt, on_fire)
