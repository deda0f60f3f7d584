"""Every environment variable ``ckpt`` reads, in one place.

Each is read when it is used, never at import (a bad value must not break ``import
ckpt``), and a value that does not parse raises ``ValueError`` naming the variable,
the value and what is expected. docs/design.md has the table of every variable of the
project; :data:`VARIABLES` is this package's part of it.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from collections.abc import Mapping

logger = logging.getLogger(__name__)

MAX_SECONDS = 1e7
"""The largest timeout a variable may give (about 115 days): a larger one overflows the
``timedelta`` of a collective, and no checkpoint call should wait that long anyway."""

STORAGE_TIMEOUT_S = "CKPT_STORAGE_TIMEOUT_S"
STORAGE_RETRIES = "CKPT_STORAGE_RETRIES"
STORAGE_RETRY_TOTAL_S = "CKPT_STORAGE_RETRY_TOTAL_S"
STORAGE_FAULTS = "CKPT_STORAGE_FAULTS"
COLLECTIVE_TIMEOUT_S = "CKPT_COLLECTIVE_TIMEOUT_S"
SAVE_BLOCK_BYTES = "CKPT_SAVE_BLOCK_BYTES"
SAVE_THREAD_NICE = "CKPT_SAVE_THREAD_NICE"
MEMORY_DIR = "CKPT_MEMORY_DIR"
XDG_RUNTIME_DIR = "XDG_RUNTIME_DIR"
LEASE_TTL_S = "CKPT_LEASE_TTL_S"
JOB_ID = "CKPT_JOB_ID"
RUN_ID = "TORCHELASTIC_RUN_ID"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_CLUSTER_NAME = "SLURM_CLUSTER_NAME"
EMULATOR_HOST = "STORAGE_EMULATOR_HOST"
GCSFS_HNS = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"

VARIABLES: dict[str, str] = {
    STORAGE_TIMEOUT_S: "seconds one storage call may take before it is retried (default 300)",
    STORAGE_RETRIES: "attempts per storage call, first included (default 6)",
    STORAGE_RETRY_TOTAL_S: "seconds of retrying per call before giving up (default 120)",
    STORAGE_FAULTS: "storage fault specs, read when a fault registry is built (tests, drills)",
    COLLECTIVE_TIMEOUT_S: "seconds a rank waits in a checkpoint collective (default 600)",
    SAVE_BLOCK_BYTES: "tensor shards above this many bytes are saved as row blocks (8 MiB)",
    SAVE_THREAD_NICE: "nice value of the background save thread (default 19; 0 disables)",
    MEMORY_DIR: "where the memory tier keeps its snapshots (default /dev/shm/ckpt-memory-<uid>; must be this user's)",
    XDG_RUNTIME_DIR: "the login session's private tmpfs: the memory tier's first fallback when another user took its default directory",
    LEASE_TTL_S: "seconds a root's owner lease lives without renewal (default 60; 0: no lease)",
    JOB_ID: "names the job for the root's owner lease: its relaunches take the lease over at once",
    RUN_ID: "set by torchrun: the run id recorded in each checkpoint's writer identity",
    RESTART_COUNT: "set by torchrun: the restart count recorded with the run id",
    MAX_RESTARTS: "set by torchrun: restarts allowed; with no periodic save each starts at step 0 (said)",
    SLURM_JOB_ID: "set by Slurm: a requeued job keeps it, so it keeps its root's lease",
    SLURM_CLUSTER_NAME: "set by Slurm: qualifies SLURM_JOB_ID in the lease's job identity",
    EMULATOR_HOST: "a GCS emulator's URL: gs:// goes there, anonymously",
    GCSFS_HNS: "set to false (when unset) for the emulator, which lacks gcsfs' HNS calls",
}


def _source(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def get_str(name: str, default: str, env: Mapping[str, str] | None = None) -> str:
    """The variable's value, or ``default`` when unset or empty."""
    return _source(env).get(name) or default


def get_int(
    name: str,
    default: int,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """An integer variable, ``default`` when unset or empty; ``ValueError`` naming it else."""
    raw = _source(env).get(name, "")
    if not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if (
        value is None
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
    ):
        bound = "an integer" if minimum is None else f"an integer >= {minimum}"
        bound += f" and <= {maximum}" if maximum is not None else ""
        raise ValueError(f"{name}={raw!r}: expected {bound} (default {default})")
    return value


def get_float(
    name: str,
    default: float,
    *,
    positive: bool = False,
    minimum: float | None = None,
    maximum: float = MAX_SECONDS,
    env: Mapping[str, str] | None = None,
) -> float:
    """A finite number variable, ``default`` when unset or empty; ``ValueError`` naming it
    else (``inf`` and ``nan`` included: no timeout or size means either)."""
    raw = _source(env).get(name, "")
    if not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = None
    if (
        value is None
        or not math.isfinite(value)
        or (positive and not value > 0)
        or (minimum is not None and value < minimum)
        or value > maximum
    ):
        kind = "a number > 0" if positive else "a finite number"
        kind += f" >= {minimum:g}" if minimum is not None else ""
        raise ValueError(f"{name}={raw!r}: expected {kind} up to {maximum:g} (default {default})")
    return value


def run_identity(env: Mapping[str, str] | None = None) -> tuple[str, int]:
    """(run id, restart count) as torchrun sets them; ("local", 0) outside torchrun."""
    return get_str(RUN_ID, "local", env), get_int(RESTART_COUNT, 0, minimum=0, env=env)


def max_restarts(env: Mapping[str, str] | None = None) -> int:
    """Restarts torchrun allows this job (``--max-restarts``); 0 outside torchrun."""
    return get_int(MAX_RESTARTS, 0, minimum=0, env=env)


DEFAULT_LEASE_TTL_S = 60.0
MAX_LEASE_TTL_S = 86400.0
"""The longest owner lease (a day), from ``CKPT_LEASE_TTL_S`` or ``lease_ttl_s=``."""


def lease_ttl_s(env: Mapping[str, str] | None = None) -> float:
    """``CKPT_LEASE_TTL_S``: seconds an owner lease lives unrenewed (0: no lease)."""
    return get_float(
        LEASE_TTL_S, DEFAULT_LEASE_TTL_S, minimum=0.0, maximum=MAX_LEASE_TTL_S, env=env
    )


def job_names(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that name the job (set ones only): ``CKPT_JOB_ID``, ``SLURM_JOB_ID``
    (with ``SLURM_CLUSTER_NAME``) and torchrun's run id."""
    source = _source(env)
    names = {JOB_ID: source.get(JOB_ID, ""), SLURM_JOB_ID: source.get(SLURM_JOB_ID, "")}
    names[SLURM_CLUSTER_NAME] = source.get(SLURM_CLUSTER_NAME, "")
    names[RUN_ID] = source.get(RUN_ID, "")
    return {k: v.strip() for k, v in names.items() if v.strip()}


def validate(env: Mapping[str, str] | None = None) -> None:
    """Parse every ``CKPT_*`` variable now, as its reader will (``ValueError`` naming the
    first bad one; ``CKPT_STORAGE_FAULTS`` is parsed by the fault registry a manager
    builds, :func:`ckpt.storage.faults.check_env`), and say at WARNING which ``CKPT_*`` names this library does not know
    (a name close to a known one: a typo leaves a setting silently at its default).

    A :class:`~ckpt.manager.CheckpointManager` calls it when built, so that a bad value
    stops a job before it trains, not at its first save.
    """
    source = _source(env)
    get_float(STORAGE_TIMEOUT_S, 300.0, positive=True, env=source)
    get_int(STORAGE_RETRIES, 6, minimum=1, maximum=1000, env=source)
    get_float(STORAGE_RETRY_TOTAL_S, 120.0, minimum=0.0, env=source)
    get_float(COLLECTIVE_TIMEOUT_S, 600.0, positive=True, env=source)
    get_int(SAVE_BLOCK_BYTES, 8 << 20, minimum=1, env=source)
    get_int(SAVE_THREAD_NICE, 19, minimum=0, maximum=19, env=source)
    lease_ttl_s(source)
    known = sorted(n for n in VARIABLES if n.startswith("CKPT_"))
    for name in sorted(n for n in source if n.startswith("CKPT_") and n not in VARIABLES):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        if close:  # a typo leaves the setting at its default; other CKPT_* names are yours
            logger.warning(
                "ckpt: environment variable %s is not one ckpt reads (did you mean %s?): ignored",
                name,
                close[0],
            )
