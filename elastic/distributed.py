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
torchrun waits for them: after a worker kill, a surviving rank whose peer had loader
workers stays in its all_reduce for seconds after torchrun's SIGTERM, instead of a
fraction of a second. ``DataLoader`` workers are also shielded
from a SIGTERM meant for their rank (:mod:`elastic.loader_workers`); ``RunGuard``
installs both too, for scripts that build the group themselves.

A rank that dies during the start-up must not hold its peers longer than the peer
failure detector's bound (5 s, 10 s more for a first heartbeat): the group's creation
waits at most that long for the other ranks (``startup_timeout_s``), and as soon as the
group exists the detector runs (:mod:`elastic.heartbeat`), through the model build, the
checkpoint manager's group and resume, until ``RunGuard`` takes it over. Without these
bounds a rank killed there would leave its peers in ``init_process_group`` or in the
checkpoint group's creation until their own timeouts, minutes later.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import logging
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elastic.faults import fire_at_point
from elastic.heartbeat import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_PEER_TIMEOUT_S,
    PeerHeartbeat,
    first_beat_bound_s,
    group_heartbeat,
    namespace,
)
from elastic.identity import RunIdentity, job_restart_count
from elastic.loader_workers import shield_loader_workers
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
    second to a second before it tries again, so two ranks forked at once (a warm
    restart) would take that long to build a group that is otherwise ready in
    milliseconds. Polling the port here every :data:`STORE_POLL_S` takes that backoff
    out of every restart.
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


def prepare_child_processes() -> None:
    """Once per process (idempotent): children forked from now on release this process's
    TCP sockets (:func:`release_inherited_sockets`), and ``DataLoader`` workers started
    from now on survive a SIGTERM meant for this process and leave with it
    (:func:`elastic.loader_workers.shield_loader_workers`).

    :func:`init_distributed` and ``elastic.RunGuard`` call it, so a script that builds its
    process group itself gets it from the guard.
    """
    _register_fork_hook()
    shield_loader_workers()


def init_distributed(
    identity: RunIdentity | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str | None = None,
    peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
    heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    startup_timeout_s: float | None = None,
) -> DistContext:
    """Initialize the default process group (every rank, once, first), pick the device and
    compute the run context (collective: the job-wide restart count).

    From then on, children this process forks release its TCP sockets as they start
    (:func:`release_inherited_sockets`; see the module docstring for why), and the peer
    failure detector runs (``peer_timeout_s``, ``heartbeat_s``: see ``elastic.RunGuard``;
    0 turns it off): a rank that dies during the start-up (model build, the checkpoint
    manager's group, resume) ends its peers within the bound instead of leaving them in a
    collective until its timeout. ``RunGuard`` takes it over with its own settings;
    :func:`close_distributed` stops it, and so does destroying the group or the exit.

    ``timeout_s`` bounds every collective of the default group, but the group's creation
    waits for the other ranks at most ``startup_timeout_s`` (default: ``peer_timeout_s`` +
    10 s, what the detector gives a first heartbeat; ``timeout_s`` when the detector is
    off): a rank that never arrives is dead, not slow.

    ``identity`` defaults to :meth:`RunIdentity.from_env` (a malformed torchrun variable
    raises ``ValueError`` naming it). An already initialized group is kept. Raises
    ``RuntimeError`` for ``WORLD_SIZE`` > 1 without ``MASTER_ADDR`` (not launched by
    torchrun and no rendezvous address given). Raises ``elastic.errors.RepeatedErrorStop``
    at once when this job's deterministic error repeated (:mod:`elastic.repeats`).
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if startup_timeout_s is None:
        startup_timeout_s = first_beat_bound_s(peer_timeout_s) or timeout_s
    if not startup_timeout_s > 0:
        raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
    identity = RunIdentity.from_env() if identity is None else identity
    stop_if_repeated(identity)
    use_cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if use_cuda else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        # A fault planned here (tests, drills) leaves the peers waiting for this rank.
        fire_at_point("init_process_group", identity.rank, identity.restart_count)
        startup = datetime.timedelta(seconds=min(startup_timeout_s, timeout_s))
        if identity.master_addr is not None:
            if identity.rank != 0 and identity.master_port is not None:
                _wait_for_store(identity.master_addr, identity.master_port, startup_timeout_s)
            dist.init_process_group(backend=backend, timeout=startup)
        elif identity.world_size == 1:
            url = f"tcp://127.0.0.1:{_free_port()}"
            dist.init_process_group(
                backend=backend, init_method=url, rank=0, world_size=1, timeout=startup
            )
        else:
            raise RuntimeError(
                f"WORLD_SIZE={identity.world_size} but MASTER_ADDR is not set; "
                "launch with torchrun or set MASTER_ADDR and MASTER_PORT"
            )
        _set_timeouts(timeout)  # the group is up: its collectives get the full bound
    prepare_child_processes()
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda and backend == "nccl":
        device = torch.device("cuda", identity.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    logger.info(
        "rank %d/%d: process group ready (backend=%s, device=%s)", rank, world, backend, device
    )
    attempt = job_restart_count(identity)  # collective: every rank is here
    _start_startup_detector(identity.run_id, attempt, heartbeat_s, peer_timeout_s)
    return DistContext(
        rank=rank,
        world_size=world,
        local_rank=identity.local_rank,
        device=device,
        backend=backend,
        run_id=identity.run_id,
        attempt=attempt,
    )


def _set_timeouts(timeout: datetime.timedelta) -> None:
    """The default group's collectives and its store's waits get ``timeout`` (they were
    created with the start-up bound)."""
    dist.distributed_c10d._set_pg_timeout(timeout)
    dist.distributed_c10d._get_default_store().set_timeout(timeout)


_startup_detector: list[PeerHeartbeat] = []
"""The peer failure detector :func:`init_distributed` started, until ``RunGuard`` takes it
(:func:`take_startup_detector`) or :func:`close_distributed` stops it; at most one."""
_LOCK = threading.Lock()


def _start_startup_detector(
    run_id: str, attempt: int, heartbeat_s: float, peer_timeout_s: float
) -> None:
    with _LOCK:
        running = _startup_detector[0] if _startup_detector else None
    world = dist.get_world_size()
    if running is not None and running.key_prefix == namespace(run_id, attempt, world):
        return  # init_distributed called again on the same group: keep the one running
    detector = group_heartbeat(
        run_id=run_id,
        attempt=attempt,
        interval_s=heartbeat_s,
        timeout_s=peer_timeout_s,
        keep_running=dist.is_initialized,  # a destroyed group has nobody left to watch
        # Its store lives in rank 0's process (torchrun's workers, unless they share the
        # agent's): rank 0 leaving, done or dead, takes it away, and without a guard a
        # rank may leave at any time. A dead rank 0 fails its peers' store waits at once;
        # only peers that stopped while the store answered are judged here.
        judge_store=False,
    )
    if detector is None:
        return
    with _LOCK:
        stale = list(_startup_detector)
        _startup_detector[:] = [detector]
    for old in stale:
        old.stop()
    _register_exit_hook()


def take_startup_detector(run_id: str, attempt: int) -> PeerHeartbeat | None:
    """The running detector :func:`init_distributed` started, handed over to the caller
    (``RunGuard``), when it watches the current group of ``run_id``'s attempt ``attempt``;
    one that watches another is stopped. None when there is none."""
    with _LOCK:
        detector = _startup_detector.pop() if _startup_detector else None
    if detector is None:
        return None
    world = dist.get_world_size() if dist.is_initialized() else 0
    if detector.running and detector.key_prefix == namespace(run_id, attempt, world):
        return detector
    detector.stop()
    return None


def _stop_startup_detector() -> None:
    with _LOCK:
        detectors = list(_startup_detector)
        _startup_detector.clear()
    for detector in detectors:
        detector.stop()


@functools.cache
def _register_exit_hook() -> None:
    """Once per process: a detector nobody took over says this rank left at exit."""
    atexit.register(_stop_startup_detector)


def close_distributed() -> None:
    """Stop the start-up failure detector if no ``RunGuard`` took it over, then destroy the
    default process group if there is one.

    Close every ``ckpt.CheckpointManager`` first (``with manager:`` does): a background
    save needs its checkpoint group until it finishes.
    """
    _stop_startup_detector()
    if dist.is_initialized():
        dist.destroy_process_group()
