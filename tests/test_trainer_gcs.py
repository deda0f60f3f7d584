"""The trainer with --ckpt-dir gs:// on the fake-gcs-server emulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ckpt
from ckpt.storage import Storage
from testing.gcs_emulator import create_bucket, emulator_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--config", "examples/tiny_gpt.toml", "--set", "model.d_model=32", "--set", "model.n_head=2",
    "--set", "data.corpus_chars=20000", "--ckpt-every", "2",
]  # fmt: skip


def run_trainer(args: list[str], endpoint: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **emulator_env(endpoint), "PYTHONPATH": REPO}
    return subprocess.run(
        [sys.executable, "-m", "trainer", *TINY, *args],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


@pytest.mark.gcs
@pytest.mark.timeout(300)
def test_trainer_checkpoints_to_gcs_and_resumes(gcs_emulator, tmp_path):
    bucket = "trainer-gcs"
    create_bucket(gcs_emulator.endpoint, bucket)
    root, run_dir = f"gs://{bucket}/run1", str(tmp_path / "run")
    first = run_trainer(
        ["--max-steps", "4", "--ckpt-dir", root, "--run-dir", run_dir], gcs_emulator.endpoint
    )
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_trainer(
        ["--max-steps", "6", "--ckpt-dir", root, "--run-dir", run_dir], gcs_emulator.endpoint
    )
    assert second.returncode == 0, second.stderr[-3000:]
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert [e["step"] for e in loaded] == [4]
    assert [e["step"] for e in events if e["event"] == "checkpoint_saved"] == [2, 4, 6]
    latest = ckpt.find_latest_committed(root)
    assert latest.step == 6
    report = ckpt.verify_dir(Storage(root).child(latest.dirname), latest.manifest)
    assert report.ok and report.crc_checked == len(latest.manifest.files)


@pytest.mark.gcs
@pytest.mark.timeout(120)
def test_trainer_refuses_a_missing_bucket_before_training(gcs_emulator, tmp_path):
    run_dir = str(tmp_path / "run")
    result = run_trainer(
        ["--max-steps", "4", "--ckpt-dir", "gs://no-such-bucket-typo/run", "--run-dir", run_dir],
        gcs_emulator.endpoint,
    )
    assert result.returncode == 1
    assert "bucket 'no-such-bucket-typo' does not exist" in result.stderr
    metrics = os.path.join(run_dir, "metrics.jsonl")
    assert not os.path.exists(metrics) or os.path.getsize(metrics) == 0  # no step ran
