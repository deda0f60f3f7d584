"""Who this process is in the job: the run identity that torchrun puts in the environment.

torchrun (torch.distributed.elastic) starts every worker with RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, TORCHELASTIC_RESTART_COUNT,
TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID, MASTER_ADDR and MASTER_PORT. They are
read once, validated, and frozen into a `RunIdentity`; nothing else in the trainer
should read these variables. Without torchrun (a plain `python -m trainer`) every
variable is optional and the process is rank 0 of a world of 1, restart 0, run id
"local".

Restart counts are per agent: each torchrun agent counts the restarts of its own
worker group, so after a worker on node A dies, node A's agent says 1 while node B's
may still say 0 (B's workers were restarted because the group was, not because B
failed), and membership changes count on no agent. The job-wide attempt number is
the maximum over all ranks: `job_restart_count`.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

ENV_RANK = "RANK"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_GROUP_RANK = "GROUP_RANK"
ENV_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
ENV_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
ENV_RUN_ID = "TORCHELASTIC_RUN_ID"
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"

LOCAL_RUN_ID = "local"
"""Run id of a process that was not started by torchrun."""


def _read_int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not an integer; "
            f"torchrun sets it to an integer >= {minimum}, unset it or fix its value"
        ) from None
    if value < minimum:
        raise ValueError(
            f"environment variable {name}={value} is out of range; it must be >= {minimum}"
        )
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class RunIdentity:
    """This process's place in the job, read once from the environment torchrun sets.

    Every rank builds its own with `RunIdentity.from_env()` at startup. Ranks are
    meaningful for one attempt only: after a restart or a membership change the same
    process slot may get another rank, so no persistent state may be keyed by `rank`.
    """

    rank: int
    """Global rank in this attempt (RANK)."""
    local_rank: int
    """Rank among the workers of this node (LOCAL_RANK)."""
    world_size: int
    """Number of workers in this attempt (WORLD_SIZE)."""
    local_world_size: int
    """Number of workers on this node (LOCAL_WORLD_SIZE)."""
    group_rank: int
    """Rank of this node's agent among the agents (GROUP_RANK)."""
    restart_count: int
    """Restarts of this agent's worker group (TORCHELASTIC_RESTART_COUNT); per agent."""
    max_restarts: int
    """Restart budget of each agent (TORCHELASTIC_MAX_RESTARTS)."""
    run_id: str
    """Rendezvous/run id (TORCHELASTIC_RUN_ID), "local" without torchrun."""
    master_addr: str | None
    """Address of the rank-0 store (MASTER_ADDR), None when unset."""
    master_port: int | None
    """Port of the rank-0 store (MASTER_PORT), None when unset."""
    hostname: str
    """Host name of this machine, recorded in checkpoint membership."""
    pid: int
    """Operating-system process id of this worker."""
    launched_by_torchrun: bool = False
    """True when a torchelastic agent started this process (TORCHELASTIC_RUN_ID set)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank={self.rank} is outside [0, world_size={self.world_size}); "
                f"check {ENV_RANK} and {ENV_WORLD_SIZE}"
            )
        if self.local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {self.local_world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local_rank={self.local_rank} is outside "
                f"[0, local_world_size={self.local_world_size}); "
                f"check {ENV_LOCAL_RANK} and {ENV_LOCAL_WORLD_SIZE}"
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(
                f"master_port={self.master_port} is not a TCP port; check {ENV_MASTER_PORT}"
            )
        if not self.run_id:
            raise ValueError(f"run_id must not be empty; check {ENV_RUN_ID}")

    @property
    def is_torchrun(self) -> bool:
        """True when this process was started by a torchrun (torchelastic) agent."""
        return self.launched_by_torchrun

    @property
    def is_coordinator(self) -> bool:
        """True on global rank 0, the rank that writes run-wide outputs."""
        return self.rank == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RunIdentity:
        """Read and validate the identity from `env` (default: `os.environ`).

        Every rank calls it once at startup. Missing variables take single-process
        defaults; a malformed value raises ValueError naming the variable.
        """
        source: Mapping[str, str] = os.environ if env is None else env
        world_size = _read_int(source, ENV_WORLD_SIZE, 1, 1)
        local_world_size = _read_int(source, ENV_LOCAL_WORLD_SIZE, 1, 1)
        master_port_raw = source.get(ENV_MASTER_PORT)
        master_port = (
            None
            if master_port_raw is None or master_port_raw.strip() == ""
            else _read_int(source, ENV_MASTER_PORT, 0, 1)
        )
        run_id = source.get(ENV_RUN_ID)
        return cls(
            rank=_read_int(source, ENV_RANK, 0, 0),
            local_rank=_read_int(source, ENV_LOCAL_RANK, 0, 0),
            world_size=world_size,
            local_world_size=local_world_size,
            group_rank=_read_int(source, ENV_GROUP_RANK, 0, 0),
            restart_count=_read_int(source, ENV_RESTART_COUNT, 0, 0),
            max_restarts=_read_int(source, ENV_MAX_RESTARTS, 0, 0),
            run_id=run_id if run_id else LOCAL_RUN_ID,
            master_addr=source.get(ENV_MASTER_ADDR) or None,
            master_port=master_port,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            launched_by_torchrun=bool(run_id),
        )

    def describe(self) -> str:
        """Short text for log lines: rank, world, restart and host."""
        return (
            f"rank={self.rank}/{self.world_size} local_rank={self.local_rank} "
            f"restart={self.restart_count} run_id={self.run_id} host={self.hostname} "
            f"pid={self.pid}"
        )


def job_restart_count(identity: RunIdentity, process_group: dist.ProcessGroup | None = None) -> int:
    """Return the job-wide restart count: the highest restart count among all ranks.

    Collective when a process group is initialized: every rank of `process_group`
    (default group when None) must call it, at the same point (typically right after
    `init_process_group`, before anything that depends on the attempt). Without a
    process group it returns the local `identity.restart_count`.
    """
    # Imported here so that reading the identity (and the watchdog, which needs the
    # rank) does not pay for importing torch.
    from elastic.collectives import all_reduce_max_ints

    (count,) = all_reduce_max_ints([identity.restart_count], process_group)
    if count != identity.restart_count:
        logger.info(
            "rank %d: local restart count %d, job-wide restart count %d",
            identity.rank,
            identity.restart_count,
            count,
        )
    return count


ENV_DISABLE_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Must be "1" in torchrun's environment for restarts to reach a working process group
(unless the rendezvous backend does not share its store, as ``--rdzv_backend=ft``)."""
ENV_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
"""Set by torchrun for its workers: "False" when they do not reuse the agent's store."""


def restart_setup_problem(env: Mapping[str, str] | None = None) -> str | None:
    """Why restarts of this torchrun job may hang, or None when they should work (pure).

    Workers see torchrun's environment. With restarts allowed
    (TORCHELASTIC_MAX_RESTARTS > 0) and TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset, a
    restarted worker group can reuse the rank-0 agent's TCP store and read stale peer
    addresses (pytorch#135712): with ``--standalone --max_restarts=1`` the restarted
    workers hang in ``init_process_group`` after a worker kill. A worker cannot fix its agent's
    environment, so this only says what to set. Workers whose agent does not share its
    store (torchrun sets TORCHELASTIC_USE_AGENT_STORE=False: ``--rdzv_backend=ft``, or
    c10d with the variable set) are fine.
    """
    source: Mapping[str, str] = os.environ if env is None else env
    try:
        max_restarts = int(source.get(ENV_MAX_RESTARTS, "0") or 0)
    except ValueError:
        return None
    if max_restarts <= 0 or source.get(ENV_DISABLE_SHARED_STORE, "") == "1":
        return None
    if source.get(ENV_USE_AGENT_STORE, "") == "False":
        return None
    return (
        f"torchrun allows {max_restarts} restart(s) but {ENV_DISABLE_SHARED_STORE}=1 is not set "
        "in its environment: a restarted worker group may hang in init_process_group "
        f"(pytorch#135712). Launch as `{ENV_DISABLE_SHARED_STORE}=1 torchrun ...`, or use "
        "`--rdzv_backend=ft`, which never shares its store."
    )
