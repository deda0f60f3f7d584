"""One job per root: the root's owner lease, and the root's identity checked at each save.

Two jobs saving under one root destroy each other: each one's retention deletes the
other's checkpoints and clears its saves in flight, and one resumes the other's step. So
the coordinator (rank 0) of a :class:`~ckpt.manager.CheckpointManager` takes the root's
*owner lease* before any training (``resume()``/``check_root()``, else the first save)
and keeps it:

- a record at the root (JSON: job, run id, restart count, host, pid, a token of this
  holder, when it was taken and last renewed, its time to live) that a holder renews
  every ``ttl_s / 4`` from a thread of its own (a renewal is a storage call that may take
  seconds or hang until its timeout: on the peer heartbeat's thread it would get the
  rank judged silent) and removes at ``close()``;
- another job finding a *fresh* lease is refused (:class:`~ckpt.errors.RootLeaseError`,
  naming the holder's run id, host and last renewal) before it writes anything; an
  *expired* one (not renewed for its ``ttl_s``: its holder is gone) is taken over and said
  at WARNING, and so is a fresh one whose holder process is known to have ended (the
  record names a process of this machine - boot id, pid namespace, pid and start time -
  that no longer runs: a relaunch on the same machine right after a crash need not wait
  out the lease);
- the same job is recognised by its name (:class:`JobIdentity`): ``CKPT_JOB_ID`` if set,
  else Slurm's ``SLURM_JOB_ID`` (a requeued job keeps its id while the recipe gives each
  requeue a new rendezvous id), else torchrun's run id (``--rdzv_id``; a torchrun restart
  keeps it). A run id of ``none`` (torchrun's default without ``--rdzv_id``) or ``local``
  (no torchrun) names no job: every such process is a job of its own, so two jobs launched
  with ``none`` are two jobs, and a restart of such a job whose rank 0 died without
  releasing waits for the lease to expire;
- every change of the record is a compare-and-swap, the backend's own
  (:class:`~ckpt.storage.base.ConditionalRecord`: on ``gs://`` ``ifGenerationMatch``, on
  ``s3://`` ``If-Match``/``If-None-Match``, on a local or mounted filesystem ``link(2)`` to
  the next generation's name), so two jobs taking over one expired lease cannot both win;
  a backend without one is refused (:class:`~ckpt.errors.RootLeaseError`), never given a
  lease two jobs could both take.

The same record is the root's identity (:meth:`RootLease.check`, run by the coordinator
before a save writes anything and again before COMPLETE): the record must still be this
holder's and, on a local filesystem, the root directory must be the one it was (device and
inode), so a root deleted and recreated, or a mount that went away (a lazy ``umount``, a
dropped gcsfuse or NFS mount, which leaves the mount point's empty underlying directory)
is a :class:`~ckpt.errors.RootChangedError` naming the root, through the manager's
save-failure policy, with nothing written there. The renewal checks the same before it
writes.

The record's names (``OWNER``, ``OWNER.<generation>``, ``.OWNER.tmp-*``,
:func:`ckpt.format.layout.is_lease_name`) are never checkpoint names: discovery, retention and ``gc`` never
take them for checkpoints or delete them. Expiry compares the holder's wall clock with
the reader's: hosts' clocks must agree to well within ``ttl_s`` (NTP does).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt import env
from ckpt.errors import (
    CheckpointError,
    RecordConflict,
    RootChangedError,
    RootLeaseError,
)
from ckpt.format.layout import LEASE_NAME
from ckpt.storage import Storage
from ckpt.storage.base import ConditionalRecord
from ckpt.storage.faults import FaultRegistry

logger = logging.getLogger(__name__)

RENEWALS_PER_TTL = 4
"""A holder renews this many times per time to live (a lease survives 3 failed renewals)."""
NAMELESS_RUN_IDS = frozenset({"", "none", "local"})
"""Run ids that name no job: torchrun's default without ``--rdzv_id``, and no torchrun."""
RECORD_FORMAT = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class JobIdentity:
    """Who asks for a root: the job's name and this process."""

    key: str
    """Equal for every attempt of one job: ``job:NAME``, ``slurm:CLUSTER:ID``, ``run:RDZV_ID``;
    ``process:HOST:PID`` when nothing names the job."""
    named_by: str
    """What the key comes from, for messages."""
    stable: bool
    """False for a ``process:`` key: another attempt of the same job cannot be recognised."""
    run_id: str
    restart_count: int
    host: str
    pid: int
    process: str = ""
    """This process on this machine (:func:`process_identity`): whether a record's holder
    still runs can be told on the same machine; empty where it cannot be known."""

    @classmethod
    def from_env(cls, source: Mapping[str, str] | None = None) -> JobIdentity:
        """From ``CKPT_JOB_ID``, ``SLURM_JOB_ID`` (+ ``SLURM_CLUSTER_NAME``) and torchrun's
        ``TORCHELASTIC_RUN_ID``/``TORCHELASTIC_RESTART_COUNT``, first set wins."""
        names = env.job_names(source)
        run_id, restart_count = env.run_identity(source)
        host, pid = socket.gethostname(), os.getpid()
        stable = True
        if env.JOB_ID in names:
            key, named_by = f"job:{names[env.JOB_ID]}", f"{env.JOB_ID}={names[env.JOB_ID]}"
        elif env.SLURM_JOB_ID in names:
            cluster = names.get(env.SLURM_CLUSTER_NAME, "")
            key = f"slurm:{cluster}:{names[env.SLURM_JOB_ID]}"
            named_by = f"{env.SLURM_JOB_ID}={names[env.SLURM_JOB_ID]}"
        elif run_id not in NAMELESS_RUN_IDS:
            key, named_by = f"run:{run_id}", f"torchrun run id {run_id!r}"
        else:
            key, stable = f"process:{host}:{pid}", False
            named_by = f"nothing (run id {run_id!r}): this process alone"
        return cls(
            key=key,
            named_by=named_by,
            stable=stable,
            run_id=run_id,
            restart_count=restart_count,
            host=host,
            pid=pid,
            process=process_identity(pid),
        )


def _machine() -> str:
    """This boot of this machine and this pid namespace (pids mean the same within it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            boot = fh.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def _start_ticks(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot), or "" when there is none."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
    except OSError:
        return ""
    fields = stat[stat.rfind(")") + 2 :].split()  # the name in parentheses may hold spaces
    return fields[19] if len(fields) > 19 else ""


def process_identity(pid: int) -> str:
    """``MACHINE/PIDNS@START`` naming process ``pid`` for as long as it runs (a reused pid
    has another start time); "" where ``/proc`` does not tell."""
    machine, start = _machine(), _start_ticks(pid)
    return f"{machine}@{start}" if machine and start else ""


def holder_is_gone(record_process: str, pid: int) -> bool:
    """Whether a lease record's holder process is known to have ended: the record names
    a process of this machine and pid namespace, and ``pid`` is now no process or another
    one. False whenever that cannot be known (another machine, an old record)."""
    machine, _, start = record_process.rpartition("@")
    if not machine or not start or machine != _machine():
        return False
    return _start_ticks(pid) != start


MAX_RECORD_TIME = 1e11
"""Record times are Unix times before this (the year 5138): a larger, infinite or NaN one
makes the record unreadable, taken over at WARNING."""
MAX_CLOCK_SKEW_S = 300.0
"""A record renewed further in the future than this is not believed: taken over at WARNING."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseRecord:
    """The owner lease as stored (JSON)."""

    job: str
    named_by: str
    run_id: str
    restart_count: int
    host: str
    pid: int
    token: str
    """This holder's (a new one per manager): tells its own records from a takeover."""
    acquired_at: float
    renewed_at: float
    """Unix time of the last renewal."""
    ttl_s: float
    process: str = ""
    """The holder's :func:`process_identity` (empty in records that do not say)."""

    def to_bytes(self) -> bytes:
        return json.dumps({"format": RECORD_FORMAT, **dataclasses.asdict(self)}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> LeaseRecord:
        """Parse a record; ``ValueError`` for anything that is not one (untrusted input)."""
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ValueError(f"not a lease record: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
            raise ValueError("not a lease record of this format")
        try:
            record = cls(
                job=_typed(data, "job", str),
                named_by=_typed(data, "named_by", str),
                run_id=_typed(data, "run_id", str),
                restart_count=_typed(data, "restart_count", int),
                host=_typed(data, "host", str),
                pid=_typed(data, "pid", int),
                token=_typed(data, "token", str),
                acquired_at=float(_typed(data, "acquired_at", (int, float))),
                renewed_at=float(_typed(data, "renewed_at", (int, float))),
                ttl_s=float(_typed(data, "ttl_s", (int, float))),
                process=_typed(data, "process", str) if "process" in data else "",
            )
        except KeyError as exc:
            raise ValueError(f"lease record without {exc}") from None
        for name in ("acquired_at", "renewed_at"):
            value = getattr(record, name)
            if not (math.isfinite(value) and 0 <= value < MAX_RECORD_TIME):
                raise ValueError(f"lease record with a bad time: {name}={value!r}")
        if not (math.isfinite(record.ttl_s) and 0 < record.ttl_s <= env.MAX_LEASE_TTL_S):
            raise ValueError(
                f"lease record with a bad ttl_s={record.ttl_s!r} (at most {env.MAX_LEASE_TTL_S:g})"
            )
        return record

    def expired(self, now: float) -> bool:
        return now > self.renewed_at + self.ttl_s or self.from_the_future(now)

    def from_the_future(self, now: float) -> bool:
        """Renewed later than any clock skew explains (a forged or broken record)."""
        return self.renewed_at > now + MAX_CLOCK_SKEW_S

    def describe(self, now: float) -> str:
        """``run 'X' (job ...) on host H (pid P), last renewed 3.1 s ago (UTC time)``."""
        when = datetime.datetime.fromtimestamp(self.renewed_at, datetime.timezone.utc)
        return (
            f"run {self.run_id!r} (job named by {self.named_by}, restart {self.restart_count}) "
            f"on host {self.host} (pid {self.pid}), last renewed {now - self.renewed_at:.1f} s "
            f"ago ({when.isoformat(timespec='seconds')})"
        )


def _typed(data: dict[str, Any], key: str, kind: Any) -> Any:
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"lease record field {key!r} is not a {kind}")
    return value


def read_lease(storage: Storage) -> LeaseRecord | None:
    """The root's lease record, or None (none, or not a record); for ``ckpt ls``."""
    try:
        record = storage.conditional_record(LEASE_NAME)
        raw = None if record is None else record.read()[0]
        return None if raw is None else LeaseRecord.from_bytes(raw)
    except (OSError, ValueError, CheckpointError):
        return None


def no_conditional_write(url: str, scheme: str) -> str:
    """Why a root on a backend without a conditional write gets no owner lease."""
    return (
        f"checkpoint root {url!r}: its storage ({scheme}://) has no atomic conditional write, "
        "which the root's owner lease needs (without one, two jobs could both take the root "
        "and delete each other's checkpoints); nothing was written. Use a root on a local "
        f"or mounted filesystem, gs:// or s3://, or run without a lease (lease_ttl_s=0, or "
        f"{env.LEASE_TTL_S}=0) if nothing else can ever use this root"
    )


def _unfaulted(storage: Storage) -> Storage:
    """Injected storage faults are planned for saves and loads, not for the lease."""
    clean = dataclasses.replace(storage.options, faults=FaultRegistry(read_env=False))
    return Storage(storage.root_url, clean)


# -- the holder --------------------------------------------------------------------------


class RootLease:
    """The owner lease of one root, held by one manager's coordinator (rank 0).

    :meth:`acquire` before any training (:meth:`try_acquire` when a caller waits between
    tries), :meth:`check` before each save writes, :meth:`close` at the end (stops the
    renewals, removes the record). Thread-safe: the renewal thread and the save
    thread share it.
    """

    def __init__(
        self, storage: Storage, job: JobIdentity, ttl_s: float, *, clock: Any = time.time
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        self.storage = _unfaulted(storage)
        self.url = self.storage.root_url
        self.job = job
        self.ttl_s = float(ttl_s)
        self.token = uuid.uuid4().hex
        self.took_over: list[str] = []
        """Run ids whose lease this holder took over (an expired one, or an earlier run of
        this job under another run id): their saves in flight can never commit."""
        self._clock = clock
        self._record = self.storage.conditional_record(LEASE_NAME)
        self._lock = threading.RLock()
        self._version: Any = None
        self._acquired_at = 0.0
        self._root_id: Any = None
        self._held = False
        self._lost = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._waited_record: LeaseRecord | None = None

    @property
    def _store(self) -> ConditionalRecord:
        if self._record is None:
            raise RootLeaseError(no_conditional_write(self.url, self.storage.backend.scheme))
        return self._record

    @property
    def held(self) -> bool:
        return self._held and not self._lost

    # -- taking it ---------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the lease, waiting only where :meth:`try_acquire` asks to (a restart of a
        job without a name); :class:`~ckpt.errors.RootLeaseError` when another job holds it."""
        while (wait_s := self.try_acquire()) is not None:
            time.sleep(wait_s)

    def try_acquire(self) -> float | None:
        """One try: None once held; seconds to wait before the next try; or raises
        :class:`~ckpt.errors.RootLeaseError` naming the holder."""
        with self._lock:
            if self.held:
                return None
            self._store.prepare()
            for _ in range(8):  # each lost compare-and-swap re-reads the record
                raw, version = self._read()
                now = self._clock()
                record, why_stale = _parse(raw)
                wait = self._judge(record, why_stale, now)
                if wait is not None:
                    return wait
                try:
                    self._write(version, now, acquired=True)
                except RecordConflict:
                    continue
                self._said_taken(record, why_stale, now)
                self._start_renewing()
                return None
            raise RootLeaseError(
                f"checkpoint root {self.url!r}: its owner lease kept changing while this job "
                "tried to take it (another job is starting on the same root); nothing was "
                "written. Give each job its own --ckpt-dir"
            )

    def _judge(self, record: LeaseRecord | None, why_stale: str, now: float) -> float | None:
        """None when this job may take the lease now; seconds to wait; or raise."""
        if record is None or why_stale or record.token == self.token:
            return None
        if record.job == self.job.key or record.expired(now):
            return None
        if holder_is_gone(record.process, record.pid):
            # Its holder ended on this machine without releasing (killed, crashed): a
            # relaunch right after a crash need not wait for the lease to expire.
            return None
        if (
            not self.job.stable
            and self.job.restart_count > 0
            and record.job.startswith("process:")
            and record.run_id == self.job.run_id
        ):
            # A restart of a job without a name (run id 'none'): the holder may be this
            # job's earlier attempt, whose rank 0 died holding the lease. Take it once it
            # expires; a holder that keeps renewing is another job.
            if self._waited_record is None or self._waited_record.token != record.token:
                self._waited_record = record
                logger.warning(
                    "ckpt: %s: the owner lease is held by %s; this job has no name (run id "
                    "%r: pass torchrun --rdzv_id or set %s) so it cannot tell its own earlier "
                    "attempt from another job: waiting up to %.0f s for the lease to expire",
                    self.url, record.describe(now), self.job.run_id, env.JOB_ID,
                    record.renewed_at + record.ttl_s - now,
                )  # fmt: skip
                return 1.0
            if record.renewed_at == self._waited_record.renewed_at:
                return min(1.0, max(0.05, record.renewed_at + record.ttl_s - now + 0.05))
        raise RootLeaseError(
            f"checkpoint root {self.url!r} is in use by another job: {record.describe(now)} "
            f"holds its owner lease, which expires {record.renewed_at + record.ttl_s - now:.0f} s "
            f"from now unless renewed. Two jobs on one root delete each other's checkpoints, so "
            f"this job ({self.job.named_by}, run {self.job.run_id!r} on {self.job.host}) stops "
            "before training, leaving nothing there. Use another --ckpt-dir; if that job is gone, "
            f"relaunch once its lease expired (or remove the root's {LEASE_NAME}* record by hand). "
            f"Relaunches of one job share the lease when they share {env.JOB_ID}, "
            f"{env.SLURM_JOB_ID} or torchrun's --rdzv_id"
        )

    def _said_taken(self, record: LeaseRecord | None, why_stale: str, now: float) -> None:
        if why_stale:
            logger.warning(
                "ckpt: %s: the owner lease record was unreadable (%s): taken over", self.url,
                why_stale,
            )  # fmt: skip
            return
        if record is None or record.token == self.token:
            logger.info("ckpt: %s: owner lease taken by %s", self.url, self.job.named_by)
            return
        if record.run_id != self.job.run_id:
            self.took_over.append(record.run_id)
        if record.job == self.job.key:
            logger.info(
                "ckpt: %s: owner lease taken over from %s (an earlier attempt of this job)",
                self.url, record.describe(now),
            )  # fmt: skip
            return
        if record.from_the_future(now):
            logger.warning(
                "ckpt: %s: the owner lease record says it was renewed %.0f s in the future "
                "(a forged or broken record: not believed): taken over by this job (%s)",
                self.url, record.renewed_at - now, self.job.named_by,
            )  # fmt: skip
            return
        if not record.expired(now):  # _judge let it through: its holder process is gone
            logger.warning(
                "ckpt: %s: the owner lease of %s was left by a process that no longer runs "
                "(pid %d on this machine): taken over by this job (%s, run %r on %s)",
                self.url, record.describe(now), record.pid, self.job.named_by,
                self.job.run_id, self.job.host,
            )  # fmt: skip
            return
        logger.warning(
            "ckpt: %s: the owner lease of %s expired %.0f s ago (its job is gone): taken over "
            "by this job (%s, run %r on %s)",
            self.url, record.describe(now), now - record.renewed_at - record.ttl_s,
            self.job.named_by, self.job.run_id, self.job.host,
        )  # fmt: skip

    # -- keeping it --------------------------------------------------------------------

    def check(self) -> None:
        """Before a save writes (coordinator): the root is still the one this job owns.

        Raises :class:`~ckpt.errors.RootChangedError` naming the root when it was deleted,
        replaced or unmounted, or its lease taken over; nothing is written then.
        """
        with self._lock:
            if not self._held:
                self.acquire()
                return
            if self._lost:
                raise RootChangedError(self._lost)
            problem = self._problem()
            if problem:
                self._lose(problem)
                raise RootChangedError(problem)

    def _problem(self) -> str:
        """Why the root is not this holder's any more ("" when it is)."""
        try:
            identity = self._store.root_identity()
        except FileNotFoundError:
            return (
                f"checkpoint root {self.url!r} no longer exists: it was deleted while this job "
                "ran. A save never recreates the root it owns; nothing was written. Restore "
                "the root (or relaunch with another --ckpt-dir)"
            )
        except OSError as exc:
            return f"checkpoint root {self.url!r} cannot be looked at ({exc}); nothing was written"
        if identity != self._root_id:
            return (
                f"checkpoint root {self.url!r} is not the directory this job started with "
                f"(device and inode {self._root_id} then, {identity} now): it was deleted and "
                "recreated, or its filesystem was unmounted (a lazy umount, a dropped "
                "gcsfuse or NFS mount leaves the mount point's underlying directory there); "
                "nothing was written. Remount or restore the root and relaunch: the job "
                "resumes from its newest committed checkpoint"
            )
        try:
            raw, version = self._read()
        except (OSError, CheckpointError) as exc:
            return f"checkpoint root {self.url!r}: its owner lease cannot be read ({exc})"
        record, _ = _parse(raw)
        if record is None:
            return (
                f"checkpoint root {self.url!r} lost its owner lease record: the root was "
                "deleted or replaced while this job ran; nothing was written. Restore the "
                "root (or relaunch with another --ckpt-dir)"
            )
        if record.token != self.token:
            now = self._clock()
            return (
                f"checkpoint root {self.url!r} was taken over by {record.describe(now)}: this "
                f"job's renewals stopped for longer than its {self.ttl_s:.0f} s lease (frozen, "
                "cut off) and another job owns the root now; this job's saves stop here"
            )
        self._version = version
        return ""

    def _lose(self, problem: str) -> None:
        if not self._lost:
            self._lost = problem
            logger.error("ckpt: %s", problem)
        self._stop.set()

    def renew(self) -> None:
        """Renew now (the renewal thread does every ``ttl_s / 4``); said at ERROR when lost."""
        with self._lock:
            if not self._held or self._lost:
                return
            problem = self._problem()
            if problem:
                self._lose(problem)
                return
            try:
                self._write(self._version, self._clock(), acquired=False)
            except RecordConflict:
                problem = self._problem()  # a write of ours whose answer was lost, or a takeover
                if problem:
                    self._lose(problem)

    def _start_renewing(self) -> None:
        self._held, self._lost = True, ""
        self._root_id = self._store.root_identity()
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name="ckpt-lease", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        failing_since: float | None = None
        while not self._stop.wait(self.ttl_s / RENEWALS_PER_TTL):
            try:
                self.renew()
                failing_since = None
            except Exception as exc:  # a storage outage: the next tick tries again
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                    logger.warning(
                        "ckpt: %s: renewing the owner lease failed (%s: %s); retrying every "
                        "%.1f s (the lease lives %.0f s unrenewed)",
                        self.url, type(exc).__name__, exc, self.ttl_s / RENEWALS_PER_TTL,
                        self.ttl_s,
                    )  # fmt: skip

    def close(self) -> None:
        """Stop renewing and remove the record (best effort: an expired lease is free anyway),
        so the next job takes the root at once and a finished job leaves no trace."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl_s)
        with self._lock:
            if not self._held or self._lost:
                self._held = False
                return
            self._held = False
            try:
                if not self._problem():
                    version = self._version
                    self._call("remove", lambda: self._store.delete(version))
            except (RecordConflict, OSError, CheckpointError) as exc:
                logger.debug("ckpt: %s: lease not released: %s", self.url, exc)

    # -- records -----------------------------------------------------------------------

    def _read(self) -> tuple[bytes | None, Any]:
        return self._call("read", self._store.read)

    def _write(self, version: Any, now: float, *, acquired: bool) -> None:
        if acquired:
            self._acquired_at = now
        record = LeaseRecord(
            job=self.job.key,
            named_by=self.job.named_by,
            run_id=self.job.run_id,
            restart_count=self.job.restart_count,
            host=self.job.host,
            pid=self.job.pid,
            token=self.token,
            acquired_at=self._acquired_at,
            renewed_at=now,
            ttl_s=self.ttl_s,
            process=self.job.process,
        )
        data = record.to_bytes()
        self._version = self._call("write", lambda: self._store.write(data, version))

    def _call(self, what: str, fn: Any) -> Any:
        """One store call under the storage timeout and retries (a lost compare-and-swap
        is an answer, not a failure)."""
        box: dict[str, Any] = {}

        def once() -> Any:
            try:
                return fn()
            except RecordConflict as exc:
                box["conflict"] = exc
                return None

        value = self.storage._call(f"{what} owner lease of {self.url}", "lease", once)
        if "conflict" in box:
            raise box["conflict"]
        return value


def take_lease(lease: RootLease | None, group: Any, root: str) -> None:
    """Collective: the coordinator (which holds ``lease``; None elsewhere) takes it, every
    rank raises its refusal (:class:`~ckpt.errors.RootLeaseError`). A wait the lease asks
    for (a restart of a job without a name) is slept between short collectives, never
    inside one."""
    from ckpt.dist import Collective  # the collectives import torch; the lease itself does not

    coll = Collective(group)

    def attempt() -> float | None:
        assert lease is not None, "the coordinator holds the lease"
        return lease.try_acquire()

    while wait_s := coll.on_coordinator(f"taking the owner lease of {root}", attempt):
        time.sleep(wait_s)


def _parse(raw: bytes | None) -> tuple[LeaseRecord | None, str]:
    """The record and "" ; (None, "") for no record; (None, why) for one that does not parse."""
    if raw is None:
        return None, ""
    try:
        return LeaseRecord.from_bytes(raw), ""
    except ValueError as exc:
        return None, str(exc)
