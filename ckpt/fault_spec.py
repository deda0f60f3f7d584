"""The storage fault grammar: what a storage fault is and how a spec of one is parsed.

Apart from :mod:`ckpt.faults` (which acts faults out) so that :mod:`ckpt.env` can check
``CKPT_STORAGE_FAULTS`` without importing the module that reads it: this module imports
nothing of ``ckpt``. The items use the key=value grammar of every fault spec in this
project (``runcore.faultspec``, shared with ``elastic.faults``). :mod:`ckpt.faults`
re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runcore.faultspec import split_fault_spec

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
