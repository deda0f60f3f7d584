"""End-to-end: one job per checkpoint root.

``python -m trainer`` under ``torchrun --standalone`` (2 ranks, gloo; each launch gets a
run id of its own, so two launches are two jobs):

1. job A trains on a root; job B is launched on the same root while A is alive (A is
   stopped with SIGSTOP while B starts, so a slow start-up of B cannot outlast A): B exits
   non-zero within seconds, before its first step, naming A's run id, host and last
   renewal; A, continued, finishes with the losses of the same job run alone, bit for bit.
2. job C's rank 0 (the lease holder) is SIGKILLed, so its lease stays behind. C runs in
   a pid namespace of its own (``unshare --pid``), as a job on another machine would: this
   machine cannot tell whether its holder still runs, so another job is refused while the
   lease is fresh, and once it expired the next launch takes it over (said at WARNING),
   resumes C's checkpoint (a WARNING names C's run id) and finishes.
3. the same kill on this machine: the relaunch right after it takes the lease over at once
   (its holder process no longer runs; said at WARNING) and resumes.

The Slurm recipe's requeue (same ``SLURM_JOB_ID``, new rendezvous id) is the same job:
``tests/e2e/test_slurm_e2e.py`` requeues and resumes on the same root.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

import ckpt
from ckpt.root.lease import JobIdentity, RootLease, read_lease
from ckpt.storage import Storage
from testing.local_cluster import REPO, read_jsonl
from testing.procs import (
    RunTimeoutError,
    run_bounded,
    signal_tree,
    torchrun_command,
    torchrun_trainer,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TINY = [
    "--config", "examples/tiny_gpt.toml", "--ckpt-every", "4",
    "--set", "model.d_model=16", "--set", "model.n_head=2", "--set", "model.n_layer=1",
    "--set", "model.seq_len=16", "--set", "data.corpus_chars=20000",
    "--set", "data.global_batch=4", "--set", "data.micro_batch=2", "--set", "run.log_every=50",
]  # fmt: skip


def train(ckpt_dir: str, run_dir: str, *args: str, own_pids: bool = False) -> tuple[object, float]:
    """The trainer under torchrun; ``own_pids``: in a pid namespace of its own."""
    started = time.monotonic()
    flags = [*TINY, *args, "--ckpt-dir", ckpt_dir, "--run-dir", run_dir]
    try:
        if own_pids:
            cmd, env = torchrun_command(flags)
            cmd = ["unshare", "--pid", "--fork", "--mount-proc", *cmd]
            result = run_bounded(cmd, env=env, cwd=REPO, timeout_s=150)
        else:
            result = torchrun_trainer(flags, cwd=REPO, timeout_s=150)
    except RunTimeoutError as exc:
        pytest.fail(str(exc))
    return result, time.monotonic() - started


def rows(run_dir: str) -> list[dict]:
    return read_jsonl(os.path.join(run_dir, "metrics.jsonl"))


def relaunch_takes_over(root: str, run_dir: str, why: str) -> str:
    """A new launch on ``root`` takes the left lease over (its WARNING says ``why``), resumes
    checkpoint 4 and finishes, removing the lease; its output."""
    relaunch, _ = train(root, run_dir, "--max-steps", "12")
    assert relaunch.returncode == 0, relaunch.stdout[-4000:]
    assert why in relaunch.stdout and "taken over by this job" in relaunch.stdout
    assert [r["step"] for r in rows(run_dir)] == list(range(5, 13))
    assert read_lease(Storage(root)) is None
    return relaunch.stdout


def test_a_second_job_is_refused_in_seconds_and_the_first_finishes_as_if_alone(
    tmp_path, monkeypatch
):
    steps = ["--max-steps", "60"]
    alone, _ = train(str(tmp_path / "alone_ckpt"), str(tmp_path / "alone_run"), *steps)
    assert alone.returncode == 0, alone.stdout[-4000:]

    root, a_run, b_run = str(tmp_path / "ckpt"), str(tmp_path / "a_run"), str(tmp_path / "b_run")
    monkeypatch.setenv("CKPT_LEASE_TTL_S", "300")  # A's lease outlives the pause below
    cmd, env = torchrun_command([*TINY, *steps, "--ckpt-dir", root, "--run-dir", a_run])
    monkeypatch.delenv("CKPT_LEASE_TTL_S")
    with open(tmp_path / "a.log", "w") as log:
        job_a = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not rows(a_run):  # A holds the root and trains
            assert job_a.poll() is None and time.monotonic() < deadline, "job A never trained"
            time.sleep(0.2)
        # A stays alive with a fresh lease but trains no further while B starts, however
        # long B's start-up takes on a loaded machine: every process of A is stopped.
        signal_tree(job_a.pid, signal.SIGSTOP)
        try:
            holder = read_lease(Storage(root))
            job_b, seconds = train(root, b_run, *steps)
        finally:
            signal_tree(job_a.pid, signal.SIGCONT)
        code_a = job_a.wait(timeout=200)
    finally:
        if job_a.poll() is None:
            signal_tree(job_a.pid, signal.SIGKILL)
            job_a.wait()
    log_a = (tmp_path / "a.log").read_text()

    assert holder is not None
    assert job_b.returncode != 0, job_b.stdout[-4000:]
    assert "RootLeaseError" in job_b.stdout and "in use by another job" in job_b.stdout
    assert f"run {holder.run_id!r}" in job_b.stdout and f"on host {holder.host}" in job_b.stdout
    assert "last renewed" in job_b.stdout
    assert rows(b_run) == []  # refused before its first step
    print(f"job B refused after {seconds:.1f} s (torchrun start-up included)")
    assert seconds < 60

    assert code_a == 0, log_a[-4000:]
    assert [(r["step"], r["loss"]) for r in rows(a_run)] == [
        (r["step"], r["loss"]) for r in rows(str(tmp_path / "alone_run"))
    ]
    assert [i.step for i in ckpt.list_checkpoints(root)] == [60, 56, 52]
    assert read_lease(Storage(root)) is None  # A's close removed it


def test_a_lease_left_by_a_killed_job_is_taken_over_once_it_expired(tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    monkeypatch.setenv("CKPT_LEASE_TTL_S", "20")
    job_c, _ = train(root, str(tmp_path / "c_run"), "--max-steps", "12",
                     "--fault", "kill:step=6:rank=0", own_pids=True)  # fmt: skip
    monkeypatch.delenv("CKPT_LEASE_TTL_S")
    assert job_c.returncode != 0
    left = read_lease(Storage(root))
    assert left is not None and left.ttl_s == 20.0  # rank 0 died holding it
    assert ckpt.find_latest_committed(root).step == 4
    # while it is fresh it keeps other jobs out (a whole launch refused: the test above)
    other = RootLease(Storage(root), JobIdentity.from_env({"CKPT_JOB_ID": "other"}), 60.0)
    with pytest.raises(ckpt.RootLeaseError, match=f"run {left.run_id!r}"):
        other.acquire()
    assert time.time() < left.renewed_at + left.ttl_s, "expired already: nothing was tested"

    time.sleep(max(0.0, left.renewed_at + left.ttl_s + 1 - time.time()))
    late = relaunch_takes_over(root, str(tmp_path / "late_run"), "expired")
    assert f"step 4 was written by run {left.run_id!r}, not by this run" in late


def test_a_lease_left_by_a_job_killed_on_this_machine_is_taken_over_at_once(tmp_path):
    root = str(tmp_path / "ckpt")
    killed, _ = train(root, str(tmp_path / "k_run"), "--max-steps", "12",
                      "--fault", "kill:step=6:rank=0")  # fmt: skip
    assert killed.returncode != 0
    left = read_lease(Storage(root))
    assert left is not None and not left.expired(time.time())  # rank 0 died holding it
    relaunch = relaunch_takes_over(root, str(tmp_path / "r_run"), "no longer runs")
    assert f"pid {left.pid}" in relaunch
