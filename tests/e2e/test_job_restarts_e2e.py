"""End-to-end: what a torchrun restart of the same job does, on the built-in trainer.

- ``--resume false``: the job starts from step 0, but its restart resumes the
  checkpoints it wrote itself (before, the restart started over and failed on the first
  save with ``CheckpointExistsError``).
- A deterministic error (a model whose shapes differ from the checkpoint's): attempts 0
  and 1 meet it at the same point, are recorded, and attempts 2 and 3 end at start-up
  instead of each loading everything to fail again.

Real ``torchrun --standalone`` processes, bounded; checked on metrics.jsonl, events.jsonl
and the output.
"""

from __future__ import annotations

import json
import os

import pytest

from testing.local_cluster import REPO
from testing.procs import RunTimeoutError, torchrun_trainer

pytestmark = pytest.mark.e2e

TINY = [
    "--config", "examples/tiny_gpt.toml",
    "--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "model.seq_len=32",
    "--set", "data.corpus_chars=20000", "--set", "data.global_batch=4", "--set", "data.micro_batch=2",
    "--set", "run.peer_timeout_s=0",
]  # fmt: skip


def trainer(args: list[str], *, max_restarts: int, tmp_path):
    """``torchrun --nproc_per_node=1 -m trainer`` with its temp dir in ``tmp_path``."""
    env_tmp = str(tmp_path / "tmp")
    os.makedirs(env_tmp, exist_ok=True)
    try:
        return torchrun_trainer(
            [*TINY, *args],
            cwd=REPO,
            nproc=1,
            max_restarts=max_restarts,
            timeout_s=150,
            env_extra={"TMPDIR": env_tmp},  # the repeated-error note of this test's job only
        )
    except RunTimeoutError as exc:
        pytest.fail(str(exc))


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.mark.timeout(300)
def test_resume_false_starts_fresh_but_a_restart_resumes_its_own_checkpoints(tmp_path):
    ckpt_dir, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
    args = ["--ckpt-dir", ckpt_dir, "--run-dir", run_dir, "--max-steps", "6", "--ckpt-every", "2",
            "--resume", "false", "--fault", "kill:step=5"]  # fmt: skip
    result = trainer(args, max_restarts=1, tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:]
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [(r["step"], r["restart_count"]) for r in rows] == [
        (1, 0), (2, 0), (3, 0), (4, 0), (5, 1), (6, 1)
    ]  # fmt: skip
    resumes = [
        e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e["event"] == "resume"
    ]
    assert [(e["step"], e["restart_count"]) for e in resumes] == [(4, 1)]

    again = trainer([*args[:-2], "--max-steps", "2"], max_restarts=0, tmp_path=tmp_path)
    assert again.returncode != 0  # a new launch with --resume false: starts over, as asked...
    assert "CheckpointExistsError" in again.stdout or "already committed" in again.stdout


@pytest.mark.timeout(300)
def test_a_repeated_shape_error_ends_the_jobs_later_attempts_at_start_up(tmp_path):
    ckpt_dir, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
    common = ["--ckpt-dir", ckpt_dir, "--run-dir", run_dir, "--ckpt-every", "2"]
    first = trainer([*common, "--max-steps", "2"], max_restarts=0, tmp_path=tmp_path)
    assert first.returncode == 0, first.stdout[-4000:]

    wider = [*common, "--max-steps", "4", "--set", "model.d_model=48"]
    result = trainer(wider, max_restarts=3, tmp_path=tmp_path)
    assert result.returncode != 0
    out = result.stdout
    recorded = [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl"))
                if e["event"] == "deterministic_error"]  # fmt: skip
    assert [(e["error"], e["point"], e["repeated"], e["restart_count"]) for e in recorded] == [
        ("CheckpointShapeError", "start-up", False, 0),
        ("CheckpointShapeError", "start-up", True, 1),
    ]
    assert "CheckpointShapeError at start-up again, as in the attempt before" in out
    for restart in (2, 3):  # ended in init_distributed: no model, no manager, no resume
        assert f"restart {restart} of this job ends at start-up" in out, out[-4000:]
    assert out.count("looking for a committed checkpoint") == 2  # attempts 0 and 1 only
