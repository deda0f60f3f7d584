"""Storage fault injection: make chosen storage calls fail, for tests and drills.

A fault matches calls by save *phase* (``shard``, ``metadata``, ``manifest``,
``complete``; ``read`` for loads; ``any``) and optionally by rank, and fires on the
next ``times`` matching calls. Kinds:

- ``http429``, ``http503``: transient HTTP errors (retried by the storage layer)
- ``timeout``, ``reset``: a timeout / connection reset (transient, retried)
- ``truncate``: the write silently loses its second half (caught by the size check, retried)
- ``permanent``: HTTP 403 (fails fast: no retry)
- ``hang``: the call never returns (the per-call timeout turns it into a transient error)
- ``kill``: SIGKILL this process in the middle of the call
- ``delay``: sleep ``delay_s`` (default 1 s; option ``delay_ms=N``) before the call, which
  then proceeds normally: a slow upload, for testing asynchronous saves

Faults live in a :class:`FaultRegistry`, installed from outside the storage code: a
:class:`ckpt.CheckpointManager` owns one and puts it in its ``StorageOptions``; the
module functions :func:`inject` / :func:`install` act on the registry of the one-off
``ckpt.save``/``ckpt.load`` (``ckpt.defaults``; it reads ``CKPT_STORAGE_FAULTS`` when
it is created). A storage call asks its registry only while something is armed
(:attr:`FaultRegistry.armed`): with no fault configured, the hot path is one attribute
read. The registry acts the fault out (:meth:`FaultRegistry.run`), and for
``truncate`` it is also what cuts the bytes a write sends (:meth:`FaultRegistry.sink`,
:meth:`FaultRegistry.body`). Its items use the key=value grammar of every fault spec in this
project (``runcore.faultspec``, shared with ``elastic.faults``), e.g.
``CKPT_STORAGE_FAULTS="ckpt-storage:phase=complete:error=kill:rank=0"``; the short form
``PHASE:KIND[:times=N][:rank=R]`` (``complete:kill:rank=0;shard:http503:times=2``) still
works.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ckpt import env
from ckpt.defaults import created, process_defaults
from runcore.faultspec import split_fault_spec

ENV_STORAGE_FAULTS = env.STORAGE_FAULTS
T = TypeVar("T")
_REGISTRY = "faults.registry"
"""The key of the one-off functions' registry in ``ckpt.defaults``."""

PHASES = ("shard", "metadata", "manifest", "complete", "read", "any")
KINDS = (
    "http429",
    "http503",
    "timeout",
    "reset",
    "truncate",
    "permanent",
    "hang",
    "kill",
    "delay",
)


class InjectedHttpError(OSError):
    """An injected HTTP error; ``code`` carries the status like gcsfs's HttpError."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True, kw_only=True)
class StorageFault:
    """One fault: fail the next ``times`` calls of ``phase`` (on ``rank``, or every rank)."""

    phase: str
    kind: str
    times: int = 1
    rank: int | None = None
    step: int | None = None
    """Only saves of this step or later (``None``: any call)."""
    delay_s: float = 1.0
    fired: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"storage fault phase {self.phase!r} is not one of {PHASES}")
        if self.kind not in KINDS:
            raise ValueError(f"storage fault kind {self.kind!r} is not one of {KINDS}")
        if self.times < 1:
            raise ValueError(f"storage fault times must be >= 1, got {self.times}")
        if self.delay_s < 0:
            raise ValueError(f"storage fault delay_s must be >= 0, got {self.delay_s}")


SPEC_NAME = "ckpt-storage"
"""Name of a storage fault in the key=value grammar shared with ``elastic`` fault specs."""
SPEC_KEYS = ("phase", "error", "times", "rank", "step", "attempt", "delay_ms")


def parse_spec_fields(text: str) -> tuple[str, dict[str, str]]:
    """Split one ``NAME[:key=value]...`` fault spec (the grammar of ``elastic.faults``)."""
    try:
        return split_fault_spec(text)
    except ValueError as exc:
        raise ValueError(f"fault spec {text!r}: {exc}") from None


def _non_negative(text: str, key: str, value: str) -> int:
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"fault spec {text!r}: {key}={value!r} is not a non-negative integer")
    return int(value)


def storage_fault_from_fields(text: str, fields: dict[str, str]) -> StorageFault:
    """A :class:`StorageFault` from the fields of a ``ckpt-storage:...`` spec.

    Keys: ``phase`` (default ``shard``), ``error`` (one of :data:`KINDS`, default
    ``permanent``), ``times`` (default 1), ``rank``, ``step`` (only saves of this step or
    later), ``delay_ms``. ``attempt`` is accepted and ignored here: a process-level fault
    plan (``elastic.FaultPlan``) decides in which attempt the fault is armed.
    """
    unknown = sorted(set(fields) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(
            f"fault spec {text!r}: unknown key(s) {unknown}; {SPEC_NAME} takes {list(SPEC_KEYS)}"
        )
    kwargs: dict[str, Any] = {
        "phase": fields.get("phase", "shard"),
        "kind": fields.get("error", "permanent"),
    }
    for key in ("times", "rank", "step"):
        if key in fields:
            kwargs[key] = _non_negative(text, key, fields[key])
    if "attempt" in fields:
        _non_negative(text, "attempt", fields["attempt"])
    if "delay_ms" in fields:
        kwargs["delay_s"] = _non_negative(text, "delay_ms", fields["delay_ms"]) / 1000.0
    return StorageFault(**kwargs)


def check_env() -> None:
    """Parse ``CKPT_STORAGE_FAULTS`` now (``ValueError`` naming the bad item), as a
    manager's registry will when it is built."""
    parse_storage_faults(env.get_str(ENV_STORAGE_FAULTS, ""))


def parse_storage_faults(text: str) -> list[StorageFault]:
    """Parse ``;``-separated storage faults (the ``CKPT_STORAGE_FAULTS`` value).

    Each item is either the key=value form shared with the trainer's ``--fault``
    (``ckpt-storage:phase=shard:error=http503:times=2:rank=1``) or the short form
    ``PHASE:KIND[:times=N][:rank=R][:delay_ms=M]``.
    """
    faults: list[StorageFault] = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        if item.split(":", 1)[0].strip() == SPEC_NAME:
            faults.append(storage_fault_from_fields(item, parse_spec_fields(item)[1]))
            continue
        head = item.split(":")
        if len(head) < 2 or "=" in head[1]:
            raise ValueError(
                f"storage fault {item!r}: expected {SPEC_NAME}:phase=P:error=E[:times=N][:rank=R]"
                " or PHASE:KIND[:times=N][:rank=R]"
            )
        _, rest = parse_spec_fields(":".join([head[0], *head[2:]]))
        if set(rest) - {"times", "rank", "delay_ms"}:
            raise ValueError(
                f"storage fault {item!r}: bad option(s) {sorted(rest)} (times=N, rank=R or delay_ms=M)"
            )
        faults.append(storage_fault_from_fields(item, {**rest, "phase": head[0], "error": head[1]}))
    return faults


class FaultRegistry:
    """The storage faults armed for one owner, and which rank and save step it is at.

    :class:`ckpt.CheckpointManager` owns one (``StorageOptions.faults``); the module
    functions below act on the one-off functions' registry (``ckpt.defaults``).
    ``read_env``: arm what ``CKPT_STORAGE_FAULTS`` says now (a bad value raises here).
    """

    def __init__(self, *, read_env: bool = False) -> None:
        self._lock = threading.Lock()
        self._faults: list[StorageFault] = []
        if read_env:
            self._faults.extend(parse_storage_faults(env.get_str(ENV_STORAGE_FAULTS, "")))
        self._truncating = threading.local()
        self.rank = 0
        """Rank of this process in the current save or load (set by ckpt)."""
        self.step: int | None = None
        """Step of the save in progress (``None`` for loads and other calls)."""

    @property
    def armed(self) -> bool:
        """Whether any fault is installed (fired or not): only then do calls consult it."""
        return bool(self._faults)

    def install(self, *faults: StorageFault) -> None:
        """Add faults for the rest of this registry's life (or until :meth:`clear`)."""
        with self._lock:
            self._faults.extend(faults)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    @contextlib.contextmanager
    def inject(self, *faults: StorageFault) -> Iterator[list[StorageFault]]:
        """Install ``faults`` for the duration of the block; yields them (see ``.fired``)."""
        self.install(*faults)
        try:
            yield list(faults)
        finally:
            with self._lock:
                for fault in faults:
                    if fault in self._faults:
                        self._faults.remove(fault)

    def take(self, phase: str) -> StorageFault | None:
        """Consume and return the first armed fault matching ``phase`` on this rank, if any.

        A ``delay`` fault is acted out here (outside the lock) and not returned: the call
        it matched then runs normally.
        """
        delayed: StorageFault | None = None
        with self._lock:
            for fault in self._faults:
                if fault.fired >= fault.times or fault.phase not in (phase, "any"):
                    continue
                if fault.rank is not None and fault.rank != self.rank:
                    continue
                if fault.step is not None and (self.step is None or self.step < fault.step):
                    continue
                fault.fired += 1
                if fault.kind != "delay":
                    return fault
                delayed = fault
                break
        if delayed is not None:
            time.sleep(delayed.delay_s)
        return None

    def run(self, phase: str, what: str, fn: Callable[[], T], timed: Callable[..., T]) -> T:
        """One storage call under this registry: ``timed(fn)`` unless a fault matches.

        ``timed`` runs a callable with the storage call's timeout. A matching fault is
        acted out inside it (``raise_for``); ``truncate`` runs ``fn`` with this thread's
        writes cut (:meth:`sink`, :meth:`body`).
        """
        fault = self.take(phase)
        if fault is None:
            return timed(fn)
        if fault.kind != "truncate":
            return timed(lambda: raise_for(fault, what))

        def truncated() -> T:
            self._truncating.active = True
            try:
                return fn()
            finally:
                self._truncating.active = False

        return timed(truncated)

    def _truncate_active(self) -> bool:
        return bool(getattr(self._truncating, "active", False))

    def sink(self, raw: Any) -> Any:
        """The stream a write sends to: ``raw``, or under ``truncate`` one that drops halves."""
        return _Truncating(raw) if self._truncate_active() else raw

    def body(self, buffers: list[memoryview | bytes]) -> list[memoryview | bytes]:
        """The buffers an upload sends: as given, or their first halves under ``truncate``."""
        if not self._truncate_active():
            return buffers
        views = [memoryview(b).cast("B") for b in buffers]
        return [v[: v.nbytes // 2] for v in views]


class _Truncating:
    """Raw-stream wrapper that silently drops the second half of every write (``truncate``)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._raw.write(view[: view.nbytes // 2])
        return view.nbytes

    def flush(self) -> None:
        self._raw.flush()


def default_registry() -> FaultRegistry:
    """The registry of the one-off ``ckpt.save``/``ckpt.load`` (``ckpt.defaults``): made on
    first use, reading ``CKPT_STORAGE_FAULTS`` then."""
    return process_defaults().part(_REGISTRY, lambda: FaultRegistry(read_env=True))


def install(*faults: StorageFault) -> None:
    """Add faults to the one-off functions' registry for the rest of this process."""
    default_registry().install(*faults)


def clear() -> None:
    """Remove every fault of the one-off functions' registry (creates nothing)."""
    defaults = created()
    registry = None if defaults is None else defaults.existing(_REGISTRY)
    if registry is not None:
        registry.clear()


def inject(*faults: StorageFault) -> contextlib.AbstractContextManager[list[StorageFault]]:
    """Install ``faults`` in the one-off functions' registry for the duration of the block."""
    return default_registry().inject(*faults)


def raise_for(fault: StorageFault, what: str) -> None:
    """Act out ``fault`` for the call described by ``what`` (all kinds but ``truncate``)."""
    message = f"injected {fault.kind} during {fault.phase}: {what}"
    if fault.kind == "http429":
        raise InjectedHttpError(429, message)
    if fault.kind == "http503":
        raise InjectedHttpError(503, message)
    if fault.kind == "permanent":
        raise InjectedHttpError(403, message)
    if fault.kind == "timeout":
        raise TimeoutError(message)
    if fault.kind == "reset":
        raise ConnectionResetError(message)
    if fault.kind == "hang":
        while True:  # the caller's timeout gives up on this thread
            time.sleep(3600)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
