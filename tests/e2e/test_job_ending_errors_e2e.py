"""End-to-end: errors a restart cannot fix end the job once, on any number of ranks per node.

- A model whose shapes differ from its checkpoint (``CheckpointShapeError``), 2 agents of
  2 workers each: attempts 0 and 1 meet it, attempts 2 and 3 end at start-up on both
  nodes. Before, the ranks of a node overwrote each other's note of the error, and the
  later attempts ran anyway.
- An unusable root (a file where the root should be): ``CheckpointDirError`` ends the job
  at its first occurrence; every later attempt ends at start-up.
- A root held by another job (``RootLeaseError``): the job is refused and ends, and no
  restart adopts the root when the other job lets it go (before, torchrun restarted it,
  and once the owner finished it resumed the owner's checkpoint and exited 0).

Real ``torchrun`` agents on gloo, bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from ckpt.root.lease import JobIdentity, RootLease
from ckpt.storage import Storage
from testing.local_cluster import REPO, ElasticJob, read_jsonl
from testing.procs import RunTimeoutError, signal_tree, torchrun_command, torchrun_trainer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TINY = [
    "--config", "examples/tiny_gpt.toml", "--ckpt-every", "2",
    "--set", "model.d_model=16", "--set", "model.n_head=2", "--set", "model.n_layer=1",
    "--set", "model.seq_len=16", "--set", "data.corpus_chars=20000",
    "--set", "data.global_batch=4", "--set", "data.micro_batch=1", "--set", "run.log_every=50",
    "--set", "run.peer_timeout_s=0",
]  # fmt: skip


def trainer(args: list[str], tmp_path, *, max_restarts: int, nproc: int = 2):
    env_tmp = str(tmp_path / "tmp")
    os.makedirs(env_tmp, exist_ok=True)
    try:
        return torchrun_trainer(
            [*TINY, *args], cwd=REPO, nproc=nproc, max_restarts=max_restarts, timeout_s=200,
            env_extra={"TMPDIR": env_tmp},
        )  # fmt: skip
    except RunTimeoutError as exc:
        pytest.fail(str(exc))


def test_a_repeated_shape_error_ends_later_attempts_on_two_nodes_of_two_ranks(tmp_path):
    data = str(tmp_path / "data")
    first = trainer(["--ckpt-dir", f"{data}/ckpt", "--run-dir", f"{data}/first",
                     "--max-steps", "2"], tmp_path, max_restarts=0)  # fmt: skip
    assert first.returncode == 0, first.stdout[-4000:]

    job = ElasticJob(
        workdir=str(tmp_path / "job"), data_dir=data, nnodes="2", nproc_per_node=2,
        max_restarts=3, rdzv_id="shape", env={"TMPDIR": str(tmp_path / "tmp")},
        trainer_args=[*TINY, "--max-steps", "4", "--set", "model.d_model=24"],
    )  # fmt: skip
    try:
        job.add_agent("a")
        job.add_agent("b")
        codes = job.wait_agents(240)
        logs = {agent.name: agent.log() for agent in job.agents}
    finally:
        job.close()
    assert all(code != 0 for code in codes.values()), codes
    recorded = [e for e in read_jsonl(os.path.join(job.run_dir, "events.jsonl"))
                if e["event"] == "deterministic_error"]  # fmt: skip
    assert [(e["error"], e["repeated"], e["restart_count"]) for e in recorded] == [
        ("CheckpointShapeError", False, 0),
        ("CheckpointShapeError", True, 1),
    ]
    for name, log in logs.items():
        for restart in (2, 3):
            # the first worker to stop ends its node's attempt (torchrun stops the other)
            assert f"restart {restart} of this job ends at start-up" in log, (name, log[-4000:])


def test_an_unusable_root_ends_the_job_at_its_first_occurrence(tmp_path):
    root = tmp_path / "not-a-dir"
    root.write_text("a file where the checkpoint root should be\n")
    result = trainer(["--ckpt-dir", str(root), "--run-dir", str(tmp_path / "run"),
                      "--max-steps", "4"], tmp_path, max_restarts=3)  # fmt: skip
    out = result.stdout
    assert result.returncode != 0
    assert "CheckpointDirError" in out
    assert "a restart cannot fix it and must not retry it" in out, out[-4000:]
    for restart in (1, 2, 3):
        assert f"restart {restart} of this job ends at start-up" in out, out[-4000:]
    assert out.count("CheckpointDirError: checkpoint root") <= 2  # attempt 0's ranks only


def test_a_refused_job_never_adopts_the_root_when_its_owner_lets_it_go(tmp_path):
    root, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "b_run")
    os.makedirs(root)
    owner = RootLease(Storage(root), JobIdentity.from_env({"CKPT_JOB_ID": "job-a"}), ttl_s=300.0)
    owner.acquire()
    cmd, env = torchrun_command(
        [*TINY, "--ckpt-dir", root, "--run-dir", run_dir, "--max-steps", "4"], max_restarts=3
    )
    env["TMPDIR"] = str(tmp_path / "tmp")
    os.makedirs(env["TMPDIR"], exist_ok=True)
    log_path = tmp_path / "b.log"
    with open(log_path, "w") as log:
        job_b = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 150
        while "RootLeaseError" not in log_path.read_text():
            assert job_b.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        owner.close()  # the owner finishes: a retry would now find the root free
        code = job_b.wait(timeout=150)
    finally:
        owner.close()
        if job_b.poll() is None:
            signal_tree(job_b.pid, signal.SIGKILL)
            job_b.wait()
    out = log_path.read_text()
    assert code != 0, out[-4000:]
    for restart in (1, 2, 3):
        assert f"restart {restart} of this job ends at start-up" in out, out[-4000:]
    metrics = os.path.join(run_dir, "metrics.jsonl")
    assert not os.path.exists(metrics) or read_jsonl(metrics) == []  # never trained
    assert os.listdir(root) == []  # nothing written under the root it was refused


def test_a_config_error_ends_the_job_at_its_first_attempt(tmp_path):
    result = trainer(["--ckpt-dir", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run"),
                      "--set", "optim.lr=-1"], tmp_path, max_restarts=2, nproc=1)  # fmt: skip
    out = result.stdout
    assert result.returncode != 0
    assert out.count("optim.lr") >= 1
    for restart in (1, 2):
        assert f"restart {restart} of this job ends at start-up" in out, out[-4000:]
        assert "ConfigError" in out
