"""Fault injection at a given (step, rank, attempt), for testing recovery for real.

Grammar (DESIGN.md, contract): `KIND:step=S[:rank=R][:attempt=A]`, from repeatable
`--fault` arguments and from the environment variable `TRAINER_FAULTS`
(`;`-separated). Command-line specs come first, then the environment's; both apply.

Kinds:

- `kill`: SIGKILL to itself (no cleanup, no flushing beyond the log flush before it).
- `exit`: exit code 1 through `os._exit(1)` after flushing logs (skips atexit and
  finally blocks, like a crash in native code that still reports an error code).
- `raise`: raise `InjectedFault` from the training loop.
- `hang`: stop making progress forever, sleeping so the GIL stays free for the
  watchdog thread (which is what should notice it).
- `sigterm`: SIGTERM to itself, as a preemption would deliver it.
- `ckpt-storage`: the next checkpoint's writes on that rank fail; the plan only
  reports it (`FaultPlan.storage_fault_due`), the trainer hands it to the checkpointer.

`rank` omitted means every rank. A fault fires only in the attempt whose job-wide
restart count equals `attempt` (default 0), so a restarted job does not fail again at
the same step.
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

logger = logging.getLogger(__name__)

ENV_FAULTS = "TRAINER_FAULTS"
"""Environment variable with `;`-separated fault specs, applied after `--fault` ones."""

ENV_SEPARATOR = ";"

SPEC_GRAMMAR = "KIND:step=S[:rank=R][:attempt=A]"


class FaultKind(str, enum.Enum):
    """What an injected fault does to the process."""

    KILL = "kill"
    EXIT = "exit"
    RAISE = "raise"
    HANG = "hang"
    SIGTERM = "sigterm"
    CKPT_STORAGE = "ckpt-storage"


VALID_KINDS: tuple[str, ...] = tuple(kind.value for kind in FaultKind)
VALID_KEYS: tuple[str, ...] = ("step", "rank", "attempt")


class InjectedFault(RuntimeError):
    """Raised by a `raise` fault; an intentional failure, never a real bug."""

    def __init__(self, spec: FaultSpec, step: int, rank: int) -> None:
        super().__init__(f"injected fault {spec} fired at step {step} on rank {rank}")
        self.spec = spec
        self.step = step
        self.rank = rank


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultSpec:
    """One parsed fault: what to do, at which step, on which rank, in which attempt."""

    kind: FaultKind
    step: int
    """Optimizer step at which it fires (ckpt-storage: first save at or after it)."""
    rank: int | None = None
    """Global rank it fires on; None means every rank."""
    attempt: int = 0
    """Job-wide restart count of the attempt it fires in."""

    def __post_init__(self) -> None:
        for name in ("step", "attempt"):
            if getattr(self, name) < 0:
                raise ValueError(f"fault {name} must be >= 0, got {getattr(self, name)}")
        if self.rank is not None and self.rank < 0:
            raise ValueError(f"fault rank must be >= 0, got {self.rank}")

    def applies_to(self, rank: int, attempt: int) -> bool:
        """True when this fault targets `rank` in the attempt numbered `attempt`."""
        return self.attempt == attempt and (self.rank is None or self.rank == rank)

    def __str__(self) -> str:
        text = f"{self.kind.value}:step={self.step}"
        if self.rank is not None:
            text += f":rank={self.rank}"
        return text + f":attempt={self.attempt}"


def _spec_error(text: str, reason: str) -> ValueError:
    return ValueError(
        f"invalid fault spec {text!r}: {reason}; expected {SPEC_GRAMMAR} with KIND one of "
        f"{', '.join(VALID_KINDS)} and keys {', '.join(VALID_KEYS)} (non-negative integers)"
    )


def parse_fault_spec(text: str) -> FaultSpec:
    """Parse one `KIND:step=S[:rank=R][:attempt=A]` spec.

    Raises ValueError naming the spec and listing the valid kinds and keys when the
    text does not follow the grammar. Pure; any rank may call it.
    """
    parts = [part.strip() for part in text.strip().split(":")]
    kind_text = parts[0]
    try:
        kind = FaultKind(kind_text)
    except ValueError:
        raise _spec_error(text, f"unknown kind {kind_text!r}") from None
    values: dict[str, int] = {}
    for part in parts[1:]:
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep:
            raise _spec_error(text, f"{part!r} is not key=value")
        if key not in VALID_KEYS:
            raise _spec_error(text, f"unknown key {key!r}")
        if key in values:
            raise _spec_error(text, f"key {key!r} given twice")
        raw = raw.strip()
        if not (raw.isascii() and raw.isdigit()):
            raise _spec_error(text, f"{key}={raw!r} is not a non-negative integer")
        values[key] = int(raw)
    if "step" not in values:
        raise _spec_error(text, "step is required")
    return FaultSpec(
        kind=kind,
        step=values["step"],
        rank=values.get("rank"),
        attempt=values.get("attempt", 0),
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
        """Return the unused process faults (not ckpt-storage) that fire at this step."""
        return [spec for _, spec in self._due(step, rank, attempt)]

    def _due(self, step: int, rank: int, attempt: int) -> list[tuple[int, FaultSpec]]:
        return [
            (index, spec)
            for index, spec in enumerate(self.specs)
            if spec.kind is not FaultKind.CKPT_STORAGE
            and index not in self._consumed
            and spec.step == step
            and spec.applies_to(rank, attempt)
        ]

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

    def storage_fault_due(self, step: int, rank: int, attempt: int) -> bool:
        """Return True once for a ckpt-storage fault whose step has been reached.

        Called by the trainer on every rank before each checkpoint save at `step`.
        A ckpt-storage spec for this rank and attempt with spec.step <= step that this
        process has not used yet is consumed and makes this return True; the trainer
        then makes that save's writes fail on this rank.
        """
        for index, spec in enumerate(self.specs):
            if (
                spec.kind is FaultKind.CKPT_STORAGE
                and index not in self._consumed
                and spec.step <= step
                and spec.applies_to(rank, attempt)
            ):
                self._consumed.add(index)
                logger.warning("rank %d step %d: injecting fault %s", rank, step, spec)
                return True
        return False

    @staticmethod
    def _act(spec: FaultSpec, step: int, rank: int) -> None:
        if spec.kind is FaultKind.RAISE:
            raise InjectedFault(spec, step, rank)
        if spec.kind is FaultKind.SIGTERM:
            _flush_logs()
            os.kill(os.getpid(), signal.SIGTERM)
            return
        _flush_logs()
        if spec.kind is FaultKind.KILL:
            os.kill(os.getpid(), signal.SIGKILL)
            # SIGKILL to oneself is delivered before kill() returns on Linux; this
            # only guards against a platform that delivers it late.
            time.sleep(10.0)
            os._exit(128 + signal.SIGKILL)
        if spec.kind is FaultKind.EXIT:
            os._exit(1)
        if spec.kind is FaultKind.HANG:
            _hang_forever()
