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

Faults are installed in-process with :func:`inject` / :func:`install`, or through
the environment variable ``CKPT_STORAGE_FAULTS`` (read at the first storage call
of a process), for example ``CKPT_STORAGE_FAULTS="complete:kill:rank=0;shard:http503:times=2"``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

ENV_STORAGE_FAULTS = "CKPT_STORAGE_FAULTS"

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


def parse_storage_faults(text: str) -> list[StorageFault]:
    """Parse ``PHASE:KIND[:times=N][:rank=R][:delay_ms=M]`` items separated by ``;``."""
    faults: list[StorageFault] = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        fields = item.split(":")
        if len(fields) < 2:
            raise ValueError(f"storage fault {item!r}: expected PHASE:KIND[:times=N][:rank=R]")
        kwargs: dict[str, Any] = {}
        for opt in fields[2:]:
            key, sep, value = opt.partition("=")
            if not sep or key not in ("times", "rank", "delay_ms") or not value.isdigit():
                raise ValueError(
                    f"storage fault {item!r}: bad option {opt!r} (times=N, rank=R or delay_ms=M)"
                )
            if key == "delay_ms":
                kwargs["delay_s"] = int(value) / 1000.0
            else:
                kwargs[key] = int(value)
        faults.append(StorageFault(phase=fields[0], kind=fields[1], **kwargs))
    return faults


_lock = threading.Lock()
_faults: list[StorageFault] = []
_env_loaded = False
_rank: int = 0


def set_rank(rank: int) -> None:
    """Tell the injector which rank this process is (ckpt does this at each save/load)."""
    global _rank
    _rank = rank


def install(*faults: StorageFault) -> None:
    """Add faults for the rest of this process (or until :func:`clear`)."""
    with _lock:
        _faults.extend(faults)


def clear() -> None:
    with _lock:
        _faults.clear()


@contextlib.contextmanager
def inject(*faults: StorageFault) -> Iterator[list[StorageFault]]:
    """Install ``faults`` for the duration of the block; yields them (see ``.fired``)."""
    install(*faults)
    try:
        yield list(faults)
    finally:
        with _lock:
            for fault in faults:
                if fault in _faults:
                    _faults.remove(fault)


def _load_env_once() -> None:
    global _env_loaded
    if _env_loaded:
        return
    _env_loaded = True
    text = os.environ.get(ENV_STORAGE_FAULTS, "")
    if text:
        _faults.extend(parse_storage_faults(text))


def take(phase: str) -> StorageFault | None:
    """Consume and return the first armed fault matching ``phase`` on this rank, if any.

    A ``delay`` fault is acted out here (outside the lock) and not returned: the call
    it matched then runs normally.
    """
    delayed: StorageFault | None = None
    with _lock:
        _load_env_once()
        for fault in _faults:
            if fault.fired >= fault.times:
                continue
            if fault.phase not in (phase, "any"):
                continue
            if fault.rank is not None and fault.rank != _rank:
                continue
            fault.fired += 1
            if fault.kind != "delay":
                return fault
            delayed = fault
            break
    if delayed is not None:
        time.sleep(delayed.delay_s)
    return None


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
