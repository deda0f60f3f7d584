"""End-to-end: a damaged newest checkpoint no longer crash-loops the job.

``python -m trainer`` under torchrun (2 ranks, ``--max_restarts=2``) trains to step 8
(checkpoints 4 and 8); one byte of a shard of checkpoint 8 is flipped; the relaunch to
step 12 falls back to step 4, quarantines 8, re-runs steps 5..12 and saves 8 and 12
again. Before quarantine that save of step 8 raised CheckpointExistsError on every
attempt. Checked on outputs: exit code, per-step losses (bitwise equal to an
uninterrupted run), the fallback/quarantine events and ``python -m ckpt ls --json``.
Once on a local root and once on the GCS emulator. And when the only checkpoint is the
damaged one, no attempt starts over from step 0 on the quarantined work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import fsspec
import pytest

from testing.local_cluster import REPO
from testing.procs import RunTimeoutError, torchrun_trainer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TRAINER_ARGS = [
    "--config", "examples/tiny_gpt.toml", "--ckpt-every", "4",
    "--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "model.seq_len=32",
    "--set", "data.corpus_chars=20000", "--set", "data.global_batch=8",
    "--set", "run.log_every=4",
]  # fmt: skip


def train(
    ckpt_dir: str, run_dir: str, max_steps: int, *, ok: bool = True
) -> subprocess.CompletedProcess:
    """Two ranks under torchrun with ``--max_restarts=2``; asserts the exit code is 0 if ``ok``."""
    args = [*TRAINER_ARGS, "--max-steps", str(max_steps), "--ckpt-dir", ckpt_dir]
    try:
        result = torchrun_trainer(
            [*args, "--run-dir", run_dir], cwd=REPO, max_restarts=2, timeout_s=120
        )
    except RunTimeoutError as exc:
        pytest.fail(str(exc))
    assert (result.returncode == 0) == ok, result.stdout[-6000:]
    return result


def jsonl(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def losses(run_dir: str) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in jsonl(os.path.join(run_dir, "metrics.jsonl"))}


def flip_a_shard_byte(ckpt_dir: str, step: int) -> None:
    fs, path = fsspec.core.url_to_fs(ckpt_dir)
    shard = f"{path}/checkpoint_{step:07d}/rank_00001.distcp"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0x10
    fs.pipe_file(shard, bytes(data))


@pytest.fixture(params=["local", "gcs"])
def roots(request, tmp_path) -> tuple[str, str]:
    """Two checkpoint roots: the uninterrupted run's and the damaged run's."""
    if request.param == "local":
        return str(tmp_path / "base_ckpt"), str(tmp_path / "ckpt")
    bucket_root = request.getfixturevalue("gcs_root")
    return f"{bucket_root}/base", f"{bucket_root}/damaged"


def test_damaged_newest_checkpoint_is_quarantined_and_the_job_finishes_bitwise(roots, tmp_path):
    base_ckpt, ckpt_dir = roots
    base_run, first_run, second_run = (str(tmp_path / n) for n in ("base", "first", "second"))
    train(base_ckpt, base_run, 12)
    expected = losses(base_run)

    train(ckpt_dir, first_run, 8)
    flip_a_shard_byte(ckpt_dir, 8)
    result = train(ckpt_dir, second_run, 12)

    resumed = losses(second_run)
    assert sorted(resumed) == list(range(5, 13)), result.stdout[-4000:]
    for step, loss in resumed.items():
        assert loss == expected[step], (step, loss, expected[step])
    events = jsonl(os.path.join(second_run, "events.jsonl"))
    names = [e["event"] for e in events]
    assert "fallback" in names and "quarantine" in names, names
    quarantine = next(e for e in events if e["event"] == "quarantine")
    assert quarantine["step"] == 8 and quarantine["path"] == "rank_00001.distcp"
    assert next(e for e in events if e["event"] == "resume")["step"] == 4
    assert "ckpt: quarantined" in result.stdout  # said at WARNING, no logging config needed

    listing = subprocess.run(
        [sys.executable, "-m", "ckpt", "ls", "--json", ckpt_dir],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    rows = [(r["step"], r["status"]) for r in json.loads(listing.stdout)]
    assert rows == [(12, "committed"), (8, "committed"), (4, "committed"), (8, "quarantined")]


def test_a_damaged_only_checkpoint_stops_every_attempt_instead_of_starting_over(tmp_path):
    """Quarantine must not turn "nothing loads" into a fresh start on the next attempt."""
    ckpt_dir, first_run, second_run = (str(tmp_path / n) for n in ("ckpt", "first", "second"))
    train(ckpt_dir, first_run, 4)
    flip_a_shard_byte(ckpt_dir, 4)
    result = train(ckpt_dir, second_run, 8, ok=False)

    # Attempt 0 quarantined the checkpoint and failed; attempts 1 and 2 found only the
    # quarantined one and failed too: no step was trained, nothing new was committed.
    assert result.stdout.count("only quarantined ones (steps [4])") >= 2, result.stdout[-4000:]
    assert "python -m ckpt gc --quarantined" in result.stdout
    metrics = os.path.join(second_run, "metrics.jsonl")
    assert not os.path.exists(metrics) or not [m for m in jsonl(metrics) if "loss" in m]
    names = os.listdir(ckpt_dir)
    assert [n for n in names if n.startswith("checkpoint_")] == [
        n for n in names if ".quarantined-" in n
    ]
