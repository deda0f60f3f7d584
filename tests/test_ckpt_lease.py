"""One job per root: the owner lease, and the root's identity checked before every save.

Two jobs on one root deleted each other's saves and one resumed the other's step; a root
deleted under a running job was silently recreated, and one whose filesystem went away
received the next saves in the mount point's underlying directory. Now the coordinator
holds the root's owner lease (refusing a second job, taking over an expired
one, recognising relaunches of one job by name), and checks before each save that the root
is still the one it leased.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import ckpt
import ckpt.errors
from ckpt import cli, env
from ckpt.format.layout import is_lease_name
from ckpt.root import lease, ownership
from ckpt.root.catalog import list_checkpoints
from ckpt.root.retention import apply_retention
from ckpt.storage import Storage
from ckpt.storage.gcs import GcsRecord
from ckpt.storage.s3 import S3Record
from testing import leases, mounts

pytestmark = pytest.mark.timeout(120)


def job(key: str, run_id: str = "r", restart: int = 0, host: str = "h1") -> lease.JobIdentity:
    return lease.JobIdentity(
        key=key, named_by=key, stable=not key.startswith("process:"), run_id=run_id,
        restart_count=restart, host=host, pid=1,
    )  # fmt: skip


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def held():
    """Leases made by a test, closed at its end (their renewal threads stopped)."""
    made: list[lease.RootLease] = []

    def make(root, who, ttl_s=60.0, clock=None) -> lease.RootLease:
        kw = {"clock": clock} if clock is not None else {}
        made.append(lease.RootLease(Storage(root), who, ttl_s, **kw))
        return made[-1]

    yield make
    for item in made:
        item.close()


@pytest.mark.parametrize(
    ("environ", "key", "stable"),
    [
        ({"CKPT_JOB_ID": "gpt-7b", "SLURM_JOB_ID": "12", "TORCHELASTIC_RUN_ID": "x"}, "job:gpt-7b", True),
        ({"SLURM_JOB_ID": "12", "SLURM_CLUSTER_NAME": "c", "TORCHELASTIC_RUN_ID": "12-0"}, "slurm:c:12", True),
        ({"SLURM_JOB_ID": "12", "TORCHELASTIC_RUN_ID": "12-1"}, "slurm::12", True),
        ({"TORCHELASTIC_RUN_ID": "abc"}, "run:abc", True),
        ({"TORCHELASTIC_RUN_ID": "none"}, None, False),
        ({}, None, False),
    ],
)  # fmt: skip
def test_which_launches_are_one_job(environ, key, stable):
    identity = lease.JobIdentity.from_env(environ)
    assert identity.stable is stable
    if key is None:  # torchrun's default run id, or no torchrun: this process alone
        assert identity.key == f"process:{identity.host}:{os.getpid()}"
    else:
        assert identity.key == key


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"[]", b'{"format": 2}', json.dumps({"format": 1, "job": "j"}).encode(), b"\xff"],
)
def test_what_is_not_a_lease_record_is_refused_as_one(raw):
    with pytest.raises(ValueError):
        lease.LeaseRecord.from_bytes(raw)


def test_a_second_job_is_refused_naming_the_holder_and_its_last_renewal(any_root, held):
    first = held(any_root, job("run:A", run_id="A", host="node-a"))
    first.acquire()
    second = held(any_root, job("run:B", run_id="B", host="node-b"))
    with pytest.raises(ckpt.RootLeaseError) as err:
        second.acquire()
    message = str(err.value)
    assert "in use by another job" in message and "run 'A'" in message
    assert "on host node-a" in message and "last renewed" in message and " s ago" in message
    first.check()  # the holder is untouched
    assert not second.held


def test_a_relaunch_of_the_same_job_takes_the_lease_over_at_once(any_root, held):
    first = held(any_root, job("slurm::12", run_id="12-0"))
    first.acquire()
    requeued = held(any_root, job("slurm::12", run_id="12-1"))  # a fresh rendezvous id
    requeued.acquire()
    with pytest.raises(ckpt.errors.RootChangedError, match="taken over"):
        first.check()  # the old attempt's saves stop here
    requeued.check()


def test_an_expired_lease_is_taken_over_and_said_at_warning(any_root, held, caplog):
    clock = Clock()
    gone = held(any_root, job("run:A", run_id="A"), ttl_s=10.0, clock=clock)
    gone.acquire()
    gone._stop.set()  # its job died: no more renewals
    clock.now += 9.0
    with pytest.raises(ckpt.RootLeaseError):
        held(any_root, job("run:B"), clock=clock).acquire()  # 1 s before it expires
    clock.now += 2.0
    taker = held(any_root, job("run:B", run_id="B"), clock=clock)
    with caplog.at_level(logging.WARNING, logger="ckpt.root.lease"):
        taker.acquire()
    assert "expired" in caplog.text and "run 'A'" in caplog.text and "taken over" in caplog.text
    assert taker.took_over == ["A"]


def _process_job(key: str, pid: int) -> lease.JobIdentity:
    return lease.JobIdentity(
        key=key, named_by=key, stable=True, run_id=key, restart_count=0, host="h1", pid=pid,
        process=lease.process_identity(pid),
    )  # fmt: skip


def test_a_fresh_lease_left_by_a_process_that_ended_here_is_taken_over_at_once(
    tmp_root, held, caplog
):
    # a crashed job relaunched at once (torchrun --standalone names each launch anew)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        crashed = held(tmp_root, _process_job("run:A", child.pid))
        crashed.acquire()
        crashed._stop.set()  # its renewals die with it
        alive = held(tmp_root, job("run:B", run_id="B"))
        with pytest.raises(ckpt.RootLeaseError, match="in use by another job"):
            alive.acquire()  # its holder still runs: another job
    finally:
        child.kill()
        child.wait(timeout=30)
    relaunch = held(tmp_root, job("run:C", run_id="C"))
    with caplog.at_level(logging.WARNING, logger="ckpt.root.lease"):
        relaunch.acquire()
    assert "no longer runs" in caplog.text and f"pid {child.pid}" in caplog.text
    assert relaunch.took_over == ["run:A"]
    with pytest.raises(ckpt.errors.RootChangedError, match="taken over"):
        crashed.check()


def test_whose_holder_is_gone_is_only_decided_on_the_same_machine():
    me = lease.process_identity(os.getpid())
    assert me and not lease.holder_is_gone(me, os.getpid())
    machine, _, start = me.rpartition("@")
    # the same pid started at another time: reused by another process
    assert lease.holder_is_gone(f"{machine}@{int(start) + 1}", os.getpid())
    # another machine, pid namespace or an old record: cannot be known, so never gone
    assert not lease.holder_is_gone(f"other-boot/pid:[1]@{start}", 2**22 + 7)
    assert not lease.holder_is_gone("", 2**22 + 7)


def test_a_closed_lease_is_gone_and_the_next_job_takes_the_root_quietly(any_root, held, caplog):
    first = held(any_root, job("run:A"))
    first.acquire()
    first.close()
    assert lease.read_lease(Storage(any_root)) is None
    with caplog.at_level(logging.WARNING, logger="ckpt.root.lease"):
        held(any_root, job("run:B")).acquire()
    assert caplog.text == ""
    record = lease.read_lease(Storage(any_root))
    assert record is not None and record.job == "run:B"


def test_two_jobs_racing_for_an_expired_lease_never_both_win(tmp_root, held):
    for round_ in range(10):
        root = f"{tmp_root}/{round_}"
        clock = Clock()
        dead = held(root, job("run:dead"), ttl_s=1.0, clock=clock)
        dead.acquire()
        dead._stop.set()  # died holding it
        clock.now += 5.0
        racers = [held(root, job(f"run:{i}"), clock=clock) for i in range(4)]
        assert leases.race(racers) == ["refused"] * 3 + ["won"], round_
        records = [n for n in os.listdir(root) if is_lease_name(n)]
        assert len(records) == 1, records  # older generations removed, no temporaries left


@pytest.mark.parametrize(
    ("root_fixture", "kind"),
    [("gcs_root", GcsRecord), ("s3_root", S3Record)],
)
def test_the_lease_on_an_object_store_is_a_compare_and_swap_on_the_objects_version(
    request, root_fixture, kind, held
):
    root = request.getfixturevalue(root_fixture)  # GCS: the generation; S3: the ETag
    first = held(root, job("run:A", run_id="A"))
    first.acquire()
    with pytest.raises(ckpt.RootLeaseError, match="run 'A'"):
        held(root, job("run:B")).acquire()
    store = Storage(root).conditional_record("OWNER")
    assert isinstance(store, kind)
    raw, generation = store.read()
    assert lease.LeaseRecord.from_bytes(raw).run_id == "A" and generation
    first.renew()  # the object moved on: a write against the old version loses
    with pytest.raises(ckpt.errors.RecordConflict):
        store.write(b"{}", generation)
    assert lease.LeaseRecord.from_bytes(store.read()[0]).token == first.token
    first.check()


def test_the_renewal_thread_keeps_the_lease_fresh(tmp_root, held):
    holder = held(tmp_root, job("run:A"), ttl_s=0.4)
    holder.acquire()
    first = lease.read_lease(Storage(tmp_root)).renewed_at
    deadline = time.monotonic() + 5
    while lease.read_lease(Storage(tmp_root)).renewed_at == first:
        assert time.monotonic() < deadline, "never renewed"
        time.sleep(0.05)
    holder.check()


def test_a_deleted_root_is_an_error_at_the_next_check_and_is_not_recreated(tmp_root, held):
    holder = held(tmp_root, job("run:A"))
    holder.acquire()
    shutil.rmtree(tmp_root)
    with pytest.raises(ckpt.errors.RootChangedError, match="no longer exists"):
        holder.check()
    holder.renew()
    assert not os.path.exists(tmp_root)


def test_a_root_deleted_and_recreated_is_not_the_root_this_job_leased(tmp_root, held):
    holder = held(tmp_root, job("run:A"))
    holder.acquire()
    shutil.rmtree(tmp_root)
    os.makedirs(tmp_root)
    # a new inode, or (ext4 reuses them) the same inode without this job's lease record
    with pytest.raises(ckpt.errors.RootChangedError, match=r"not the directory this job|deleted or rep"):
        holder.check()
    assert os.listdir(tmp_root) == []


def _manager(root: str, **kw) -> ckpt.CheckpointManager:
    return ckpt.CheckpointManager(root, {"model": torch.nn.Linear(3, 2)}, **kw)


def test_a_second_manager_of_another_job_is_refused_before_it_writes_anything(
    tmp_root, monkeypatch
):
    monkeypatch.setenv(env.JOB_ID, "job-a")
    with _manager(tmp_root, every=1) as first:
        first.resume()
        first.maybe_save(1)
        before = sorted(os.listdir(tmp_root))
        monkeypatch.setenv(env.JOB_ID, "job-b")
        second = _manager(tmp_root, every=1)
        with pytest.raises(ckpt.RootLeaseError, match="in use by another job"):
            second.resume()
        with pytest.raises(ckpt.RootLeaseError):
            second.maybe_save(2)  # a script that never resumed is refused at its first save
        second.close()
        assert sorted(os.listdir(tmp_root)) == before
        first.maybe_save(2)
    # the first job released it at close: the second starts at once, from the first's step
    with _manager(tmp_root) as again:
        assert again.resume() == 2


def test_a_resume_from_another_runs_checkpoint_is_said_at_warning(tmp_root, monkeypatch, caplog):
    monkeypatch.setenv(env.RUN_ID, "first-run")
    with _manager(tmp_root, every=1) as first:
        first.resume()
        first.maybe_save(1)
    monkeypatch.setenv(env.RUN_ID, "second-run")
    with caplog.at_level(logging.WARNING), _manager(tmp_root) as second:
        assert second.resume() == 1
    assert "written by run 'first-run', not by this run 'second-run'" in caplog.text
    assert second.last_resume is not None and second.last_resume.run_id == "first-run"


def test_retention_gc_and_discovery_leave_the_lease_alone(tmp_root, capsys):
    with _manager(tmp_root, every=1, retention=ckpt.RetentionPolicy(keep_last=1)) as manager:
        manager.resume()
        for step in range(1, 5):
            manager.maybe_save(step)
        held_records = [n for n in os.listdir(tmp_root) if is_lease_name(n)]
        assert len(held_records) == 1
        apply_retention(tmp_root, ckpt.RetentionPolicy(keep_last=1))
        assert cli.main(["gc", tmp_root, "--keep-last", "1", "--quarantined"]) == 0
        assert [n for n in os.listdir(tmp_root) if is_lease_name(n)] == held_records
        assert [i.step for i in list_checkpoints(tmp_root)] == [4]
        capsys.readouterr()
        assert cli.main(["ls", tmp_root]) == 0
        assert "owner lease (held)" in capsys.readouterr().out
    assert not any(is_lease_name(n) for n in os.listdir(tmp_root))  # removed at close


def test_no_lease_when_its_time_to_live_is_zero(tmp_root, monkeypatch):
    monkeypatch.setenv(env.LEASE_TTL_S, "0")
    with _manager(tmp_root, every=1) as manager:
        manager.resume()
        manager.maybe_save(1)
        assert manager.lease is None
    assert not any(is_lease_name(n) for n in os.listdir(tmp_root))
    monkeypatch.setenv(env.LEASE_TTL_S, "soon")
    with pytest.raises(ValueError, match="CKPT_LEASE_TTL_S"):
        _manager(tmp_root)


@pytest.fixture
def can_mount() -> None:
    problem = mounts.mount_problem()
    if problem is not None:
        pytest.skip(problem)


def _failed_saves(events: list) -> list[tuple[int, str]]:
    return [(step, f["error"]) for name, step, f in events if name == "checkpoint_failed"]


def test_a_tmpfs_root_deleted_and_recreated_under_a_running_job_gets_no_save(
    tmp_path, can_mount, caplog
):
    mount = str(tmp_path / "mnt")
    events: list = []
    with mounts.tmpfs(mount, size="4m"):
        root = os.path.join(mount, "ckpt")
        manager = _manager(
            root, every=1, max_failures=2, on_event=lambda *a, **f: events.append((*a, f))
        )
        with manager:
            manager.resume()
            assert manager.maybe_save(1)
            shutil.rmtree(root)
            os.makedirs(root)  # what a cleanup script, or another job, would do
            with caplog.at_level(logging.ERROR):
                assert manager.maybe_save(2) is None
            assert os.listdir(root) == []  # nothing written into the new directory
            with pytest.raises(ckpt.TooManySaveFailuresError):
                manager.maybe_save(3)  # the save-failure policy stops the job
            assert os.listdir(root) == []
    assert [step for step, _ in _failed_saves(events)] == [2, 3]
    for _, error in _failed_saves(events):
        assert root in error and ("not the directory" in error or "deleted or replaced" in error)
    assert any(r.levelno == logging.ERROR and root in r.getMessage() for r in caplog.records)


def test_a_root_whose_mount_went_away_gets_no_save_in_the_mount_point(tmp_path, can_mount, caplog):
    mount = str(tmp_path / "mnt")
    os.makedirs(mount)
    events: list = []
    with mounts.tmpfs(mount, size="4m"):
        manager = _manager(mount, every=1, on_event=lambda *a, **f: events.append((*a, f)))
        manager.resume()
        assert manager.maybe_save(1)
        mounts.lazy_unmount(mount)  # a dropped NFS/gcsfuse mount: the path is the disk below
        with caplog.at_level(logging.ERROR):
            assert manager.maybe_save(2) is None
        manager.close()
        assert os.listdir(mount) == []  # the underlying directory received nothing
    ((step, error),) = _failed_saves(events)
    assert step == 2 and mount in error and "unmounted" in error
    assert any(
        r.levelno == logging.ERROR and "not the directory this job started with" in r.getMessage()
        for r in caplog.records
    )


def test_a_dead_jobs_save_in_flight_is_cleared_once_its_lease_was_taken_over(tmp_root, monkeypatch):
    monkeypatch.setenv(env.RUN_ID, "dead-run")
    dead = _manager(tmp_root, every=1, lease_ttl_s=0.3)
    dead.resume()
    assert dead.maybe_save(1)
    dead.lease._stop.set()  # the job dies: no renewal, no close
    # ...while its save of step 2 was being written (its ATTEMPT record names its run)
    Storage(tmp_root).child("checkpoint_0000002").write_bytes(
        "ATTEMPT", ownership.attempt_record("dead-run", 0, "x", "h"), phase="attempt"
    )
    time.sleep(0.5)  # the lease expires
    monkeypatch.setenv(env.RUN_ID, "new-run")
    policy = ckpt.RetentionPolicy(keep_last=2)
    with _manager(tmp_root, every=1, retention=policy) as new:
        assert new.resume() == 1
        assert new.lease.took_over == ["dead-run"]
        assert new.maybe_save(3)
    assert [(i.step, i.status) for i in list_checkpoints(tmp_root)] == [
        (3, "committed"),
        (1, "committed"),
    ]


def test_a_lease_record_that_does_not_parse_is_taken_over_at_warning(tmp_root, held, caplog):
    os.makedirs(tmp_root)
    with open(os.path.join(tmp_root, "OWNER.0000000003"), "wb") as fh:
        fh.write(b'{"format": 1, "job": ')  # garbage: must never block the root for good
    taker = held(tmp_root, job("run:B"))
    with caplog.at_level(logging.WARNING, logger="ckpt.root.lease"):
        taker.acquire()
    assert "unreadable" in caplog.text and "taken over" in caplog.text
    assert [n for n in os.listdir(tmp_root) if is_lease_name(n)] == ["OWNER.0000000004"]
    taker.check()


def test_a_restart_of_a_job_without_a_name_waits_for_its_own_dead_lease(tmp_root, held, caplog):
    """torchrun's default run id 'none' names no job: a restarted attempt cannot tell its
    dead rank 0's lease from another job's, so it waits for it to expire, and refuses one
    that someone keeps renewing."""
    clock = Clock()
    dead = held(tmp_root, job("process:h1:10", run_id="none"), ttl_s=20.0, clock=clock)
    dead.acquire()
    dead._stop.set()  # rank 0 died holding it
    restarted = held(tmp_root, job("process:h2:20", run_id="none", restart=1), clock=clock)
    with caplog.at_level(logging.WARNING, logger="ckpt.root.lease"):
        assert restarted.try_acquire() == 1.0
    assert "has no name" in caplog.text and "waiting up to 20 s" in caplog.text
    clock.now += 10.0
    assert restarted.try_acquire() > 0  # still waiting
    clock.now += 11.0
    assert restarted.try_acquire() is None and restarted.held
    # a first launch (restart 0) with run id 'none' is another job: refused at once
    with pytest.raises(ckpt.RootLeaseError):
        held(tmp_root, job("process:h3:30", run_id="none"), clock=clock).try_acquire()


def test_a_job_without_a_name_refuses_a_lease_that_keeps_being_renewed(tmp_root, held):
    clock = Clock()
    alive = held(tmp_root, job("process:h1:10", run_id="none"), ttl_s=20.0, clock=clock)
    alive.acquire()
    other = held(tmp_root, job("process:h2:20", run_id="none", restart=1), clock=clock)
    assert other.try_acquire() == 1.0
    clock.now += 5.0
    alive.renew()  # the holder is alive: another job that happens to have no name either
    with pytest.raises(ckpt.RootLeaseError, match="in use by another job"):
        other.try_acquire()


def _forged(tmp_root: str, name: str = "OWNER.0000000003", **fields) -> None:
    record = {"format": 1, "job": "run:A", "named_by": "x", "run_id": "A", "restart_count": 0,
              "host": "h", "pid": 1, "token": "t", "acquired_at": time.time(),
              "renewed_at": time.time(), "ttl_s": 60.0, **fields}  # fmt: skip
    os.makedirs(tmp_root, exist_ok=True)
    with open(os.path.join(tmp_root, name), "w") as fh:
        fh.write(json.dumps(record).replace('"__inf__"', "Infinity"))


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"renewed_at": "__inf__"}, "unreadable"),
        ({"renewed_at": 1e300}, "unreadable"),
        ({"acquired_at": -5.0}, "unreadable"),
        ({"ttl_s": 1e12}, "unreadable"),
        ({"renewed_at": time.time() + 1e6}, "in the future"),
    ],
)  # fmt: skip
def test_a_lease_record_with_impossible_times_is_taken_over_and_ls_lists_the_root(
    tmp_root, held, caplog, capsys, fields, said
):
    _forged(tmp_root, **fields)
    assert cli.main(["ls", tmp_root]) in (0, 1)  # no OverflowError
    capsys.readouterr()
    taker = held(tmp_root, job("run:B", run_id="B"))
    with caplog.at_level(logging.WARNING, logger="ckpt.root.lease"):
        taker.acquire()
    assert said in caplog.text and "taken over" in caplog.text
    taker.check()


def test_a_fifo_named_like_a_lease_record_is_refused_in_seconds_never_a_hang(tmp_root, held):
    os.makedirs(tmp_root)
    os.mkfifo(os.path.join(tmp_root, "OWNER.0000000007"))
    started = time.monotonic()
    assert lease.read_lease(Storage(tmp_root)) is None
    with pytest.raises(ckpt.RootLeaseError, match="not a regular file"):
        held(tmp_root, job("run:B")).acquire()
    assert time.monotonic() - started < 10
    assert os.path.exists(os.path.join(tmp_root, "OWNER.0000000007"))  # not ours: left alone


def test_a_generation_past_ten_digits_is_still_seen_and_every_save_commits(tmp_root, held):
    _forged(tmp_root, name="OWNER.9999999999", renewed_at=time.time() - 3600.0)  # expired
    taker = held(tmp_root, job("run:B", run_id="B"))
    taker.acquire()
    assert [n for n in os.listdir(tmp_root) if is_lease_name(n)] == ["OWNER.10000000000"]
    taker.check()
    taker.renew()
    assert [n for n in os.listdir(tmp_root) if is_lease_name(n)] == ["OWNER.10000000001"]
    taker.check()
