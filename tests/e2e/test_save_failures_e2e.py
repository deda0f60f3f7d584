"""End-to-end: ``python -m trainer`` under torchrun (2 ranks) on roots that cannot keep its
checkpoints stops with a non-zero exit instead of training for nothing.

Real ``torchrun --standalone`` processes with a hard deadline (``testing.procs``); the
roots are real tmpfs mounts (``testing.mounts``: a read-only one, a 6 MB one), unmounted
at the end of each test. Checked on the run's outputs: the exit code, metrics.jsonl and
the checkpoint directories; the message only for naming the root and the full disk.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

import ckpt
from testing import mounts
from testing.local_cluster import REPO, read_jsonl
from testing.procs import RunTimeoutError, torchrun_trainer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

RUN_TIMEOUT_S = 90
TRAINER_ARGS = [
    "--config", "examples/tiny_gpt.toml", "--max-steps", "12", "--ckpt-every", "2",
    "--set", "run.log_every=1", "--set", "data.corpus_chars=20000",
]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _can_mount() -> None:
    problem = mounts.mount_problem()
    if problem is not None:
        pytest.skip(problem)


def train(ckpt_dir: str, run_dir: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """``python -m trainer`` on 2 ranks (no restarts); the result and its wall seconds."""
    started = time.monotonic()
    try:
        result = torchrun_trainer(
            [*TRAINER_ARGS, *args, "--ckpt-dir", ckpt_dir, "--run-dir", run_dir],
            cwd=REPO,
            timeout_s=RUN_TIMEOUT_S,
        )
    except RunTimeoutError as exc:
        pytest.fail(str(exc))
    return result, time.monotonic() - started


def metrics(run_dir: str) -> list[dict]:
    return read_jsonl(os.path.join(run_dir, "metrics.jsonl"))


def test_an_unwritable_root_stops_the_job_before_any_step(tmp_path):
    mount, run_dir = str(tmp_path / "ro"), str(tmp_path / "run")
    with mounts.tmpfs(mount, size="1m"):
        root = os.path.join(mount, "ckpt")
        os.makedirs(root)
        mounts.make_read_only(mount)
        result, seconds = train(root, run_dir)
    assert result.returncode != 0, result.stdout[-4000:]
    assert "CheckpointDirError" in result.stdout and root in result.stdout, result.stdout[-4000:]
    assert metrics(run_dir) == []  # not one step trained
    assert seconds < 60


def test_a_full_disk_stops_the_job_says_so_and_leaves_no_partial_directory(tmp_path):
    mount, run_dir = str(tmp_path / "small"), str(tmp_path / "run")
    with mounts.tmpfs(mount, size="6m"):
        # ~4.8 MB per checkpoint (model + AdamW): the one of step 2 fits, no later one does.
        result, _ = train(mount, run_dir, "--set", "model.d_model=128")
        infos = ckpt.list_checkpoints(mount)
        names = sorted(os.listdir(mount))
    assert result.returncode != 0, result.stdout[-4000:]
    assert "TooManySaveFailuresError" in result.stdout, result.stdout[-4000:]
    assert "no space left on device" in result.stdout, result.stdout[-4000:]
    assert [(i.step, i.committed) for i in infos] == [(2, True)]
    assert names == ["checkpoint_0000002"]  # the failed saves' directories are gone
    # max_failures=3 saves in a row (steps 4, 6, 8) failed: the job stopped at step 8.
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 9))
