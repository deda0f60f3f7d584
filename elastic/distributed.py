"""The default process group for torchrun and for a plain single process.

One public call that the built-in trainer and user scripts share::

    ctx = elastic.init_distributed()        # rank, world size, device, backend
    ...
    elastic.close_distributed()             # after the CheckpointManager is closed

Under torchrun (``MASTER_ADDR`` and ``MASTER_PORT`` set) the group is built from the
environment. Without them a 1-rank group is created on a free loopback port, so the
same code path (FSDP2, DCP, collectives) runs in one process. The backend is ``nccl``
when CUDA is available, else ``gloo``; the device is ``cuda:LOCAL_RANK`` (modulo the
visible devices) or the CPU. The timeout bounds every collective on the default
group: a dead peer becomes an error instead of a stall.

Forked children (``DataLoader`` workers, ``fork`` multiprocessing) let go of the
parent's TCP sockets as they start (:func:`release_inherited_sockets`, registered once
per process by :func:`init_distributed`). Without it a killed rank's loader workers keep
its gloo connections open until they notice their parent is gone (up to
``MP_STATUS_CHECK_INTERVAL``, 5 s), so its peers learn of the death that much later and
torchrun waits for them: measured here, a worker kill with ``DataLoader(num_workers=2)``
kept the surviving rank in its all_reduce 6.5 s after torchrun's SIGTERM (0.03 s with
the release; 0.06 s without loader workers).
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import socket
import stat
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elastic.identity import RunIdentity, job_restart_count
from elastic.repeats import stop_if_repeated

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
"""Collective timeout of the default group (seconds)."""


@dataclass(frozen=True, slots=True)
class DistContext:
    """This process's place in the job and the device it computes on: the run context.

    Computed once, right after the process group exists, and passed to what needs it
    (``RunGuard(attempt=ctx.attempt)``, a manager's metadata, the run log).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    run_id: str = "local"
    """torchrun's ``TORCHELASTIC_RUN_ID`` (``--rdzv_id``), ``"local"`` without torchrun."""
    attempt: int = 0
    """The job-wide restart count: the highest ``TORCHELASTIC_RESTART_COUNT`` of all ranks."""
    host: str = field(default_factory=socket.gethostname)
    started_at: float = field(default_factory=time.time)
    """Unix time when this process's context was built."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STORE_POLL_S = 0.005
"""How often a rank other than 0 tries the rendezvous store's port before it is up."""


def _wait_for_store(addr: str, port: int, timeout_s: float) -> float:
    """Return once ``addr:port`` accepts a TCP connection (or after ``timeout_s``; then
    ``init_process_group`` reports the failure its own way); returns the seconds waited.

    Rank 0 hosts the store the group is built over. A rank that tries it before rank 0
    listens gets its connection refused and PyTorch's client backs off for about half a
    second to a second before it tries again: measured here, two ranks forked at once
    (a warm restart) built their group in 0.29-0.60 s instead of 0.01-0.03 s. Polling the
    port here every :data:`STORE_POLL_S` takes that backoff out of every restart.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(5.0, timeout_s))).close()
            reached = True
            break
        except OSError:
            if time.monotonic() >= deadline:
                reached = False
                break
            time.sleep(STORE_POLL_S)
    waited = time.monotonic() - start
    state = "reachable" if reached else "still not reachable"
    logger.debug("store %s:%d %s after %.3f s", addr, port, state, waited)
    return waited


def release_inherited_sockets() -> int:
    """In a child forked from a training process: drop its references to the parent's
    TCP sockets (gloo connections, TCPStore clients and servers); returns how many.

    Each such descriptor is replaced by ``/dev/null`` (``dup2``): the number stays
    taken, so a stale Python socket object closing it later cannot close a file the
    child opened since, and the connection now belongs to the parent alone: when the
    parent dies its peers see the connection reset at once. Unix-domain sockets (the
    descriptor passing of ``torch.multiprocessing``) and pipes are left alone.
    """
    released = 0
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd <= 2 or fd == devnull:
                continue
            try:
                if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                    continue
                probe = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            with probe:
                inet = probe.family in (socket.AF_INET, socket.AF_INET6)
            if inet:
                os.dup2(devnull, fd)
                released += 1
    finally:
        os.close(devnull)
    return released


def _release_in_child() -> None:
    try:
        release_inherited_sockets()
    except Exception:  # a fork hook must never break the child
        pass


@functools.cache
def _register_fork_hook() -> None:
    """Once per process: forked children release the parent's TCP sockets."""
    os.register_at_fork(after_in_child=_release_in_child)


def init_distributed(
    identity: RunIdentity | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str | None = None,
) -> DistContext:
    """Initialize the default process group (every rank, once, first), pick the device and
    compute the run context (collective: the job-wide restart count).

    From then on, children this process forks release its TCP sockets as they start
    (:func:`release_inherited_sockets`; see the module docstring for why).

    ``identity`` defaults to :meth:`RunIdentity.from_env` (a malformed torchrun variable
    raises ``ValueError`` naming it). An already initialized group is kept. Raises
    ``RuntimeError`` for ``WORLD_SIZE`` > 1 without ``MASTER_ADDR`` (not launched by
    torchrun and no rendezvous address given). Raises ``elastic.errors.RepeatedErrorStop``
    at once when this job's deterministic error repeated (:mod:`elastic.repeats`).
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    identity = RunIdentity.from_env() if identity is None else identity
    stop_if_repeated(identity)
    use_cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if use_cuda else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if identity.master_addr is not None:
            if identity.rank != 0 and identity.master_port is not None:
                _wait_for_store(identity.master_addr, identity.master_port, timeout_s)
            dist.init_process_group(backend=backend, timeout=timeout)
        elif identity.world_size == 1:
            url = f"tcp://127.0.0.1:{_free_port()}"
            dist.init_process_group(
                backend=backend, init_method=url, rank=0, world_size=1, timeout=timeout
            )
        else:
            raise RuntimeError(
                f"WORLD_SIZE={identity.world_size} but MASTER_ADDR is not set; "
                "launch with torchrun or set MASTER_ADDR and MASTER_PORT"
            )
    _register_fork_hook()
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda and backend == "nccl":
        device = torch.device("cuda", identity.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    logger.info(
        "rank %d/%d: process group ready (backend=%s, device=%s)", rank, world, backend, device
    )
    return DistContext(
        rank=rank,
        world_size=world,
        local_rank=identity.local_rank,
        device=device,
        backend=backend,
        run_id=identity.run_id,
        attempt=job_restart_count(identity),  # collective: every rank is here
    )


def close_distributed() -> None:
    """Destroy the default process group if there is one.

    Close every ``ckpt.CheckpointManager`` first (``with manager:`` does): a background
    save needs its checkpoint group until it finishes.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
