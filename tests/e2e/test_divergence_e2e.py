"""End-to-end: a run whose loss turns NaN stops, or rolls back and skips the data.

``python -m trainer`` under torchrun (2 ranks, gloo), the NaN injected by the ``nan``
fault at step S (rank 1's parameters become NaN at the start of S: its loss, everyone's
after the all-reduce, and the parameters after the step are NaN, as in a real divergence).
Checked on the run's outputs: the exit code, metrics.jsonl, events.jsonl and the
checkpoints, each verified with ``python -m ckpt verify --finite``.

1. ``run.divergence=stop`` (the default): the workers exit 3 naming step S and the last
   checkpoint; the newest committed checkpoint is the one before S, finite, and retention
   kept it (nothing non-finite was ever committed to push it out).
2. ``run.divergence=rollback`` with ``run.rollback_skip=K``: the run finishes; after the
   rollback every step trains the global batch K further on than the first pass would
   have (the sample ids, from the global order, and the data cursor say so); every
   checkpoint is finite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ckpt
from elastic.sampler import GlobalOrder, samples_digest
from testing.local_cluster import REPO
from testing.procs import RunTimeoutError, torchrun_trainer
from trainer.config import load_config
from trainer.data import build_samples

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SETTINGS = [
    "model.d_model=16", "model.n_head=2", "model.n_layer=1", "model.seq_len=16",
    "data.corpus_chars=20000", "data.global_batch=4", "data.micro_batch=2",
]  # fmt: skip
GLOBAL_BATCH = 4


def train(ckpt_dir: str, run_dir: str, *args: str) -> subprocess.CompletedProcess[str]:
    sets = [x for s in SETTINGS for x in ("--set", s)]
    try:
        return torchrun_trainer(
            ["--config", "examples/tiny_gpt.toml", *sets, "--ckpt-dir", ckpt_dir,
             "--run-dir", run_dir, *args],
            cwd=REPO,
            timeout_s=150,
        )  # fmt: skip
    except RunTimeoutError as exc:
        pytest.fail(str(exc))


def jsonl(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def verify_finite(ckpt_dir: str, step: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckpt", "verify", ckpt_dir, "--step", str(step), "--finite"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_nan_stops_the_run_naming_the_step_and_keeps_the_last_finite_checkpoint(tmp_path):
    ckpt_dir, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
    result = train(
        ckpt_dir, run_dir, "--max-steps", "20", "--ckpt-every", "2",
        "--set", "checkpoint.keep_last=2", "--fault", "nan:step=7:rank=1",
    )  # fmt: skip
    out = result.stdout
    assert result.returncode != 0, out[-4000:]
    assert out.count("exitcode  : 3") == 2, out[-4000:]  # both workers: Diverged
    assert "step 7: the loss is nan: training diverged" in out, out[-4000:]
    assert "The last checkpoint is step 6" in out, out[-4000:]
    committed = [i.step for i in ckpt.list_checkpoints(ckpt_dir) if i.committed]
    assert committed == [6, 4]  # the newest finite one, kept by retention (keep_last=2)
    assert ckpt.list_checkpoints(ckpt_dir)[0].step == 6  # nothing newer, not even partial
    for step in committed:
        check = verify_finite(ckpt_dir, step)
        assert check.returncode == 0 and "every floating tensor finite" in check.stdout, check
    assert [r["step"] for r in jsonl(f"{run_dir}/metrics.jsonl")] == list(range(1, 7))
    (diverged,) = [e for e in jsonl(f"{run_dir}/events.jsonl") if e["event"] == "diverged"]
    assert diverged["step"] == 7 and diverged["loss"] == "nan"
    assert diverged["policy"] == diverged["action"] == "stop"
    assert diverged["last_checkpoint_step"] == 6


def test_a_nan_with_rollback_skips_exactly_k_batches_and_every_checkpoint_is_finite(tmp_path):
    ckpt_dir, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
    skip, diverged_at, restored = 3, 10, 8
    result = train(
        ckpt_dir, run_dir, "--max-steps", "16", "--ckpt-every", "4",
        "--set", "checkpoint.keep_last=0", "--set", "run.divergence=rollback",
        "--set", f"run.rollback_skip={skip}", "--fault", f"nan:step={diverged_at}:rank=1",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    assert "rolled back to step 8" in result.stdout, result.stdout[-4000:]

    events = jsonl(f"{run_dir}/events.jsonl")
    (rollback,) = [e for e in events if e["event"] == "rolled_back"]
    assert (rollback["from_step"], rollback["to_step"]) == (diverged_at, restored)
    assert rollback["skipped_batches"] == skip
    first_skipped = restored * GLOBAL_BATCH
    assert rollback["skipped_positions"] == [first_skipped, first_skipped + skip * GLOBAL_BATCH]

    cfg = load_config(os.path.join(REPO, "examples/tiny_gpt.toml"), SETTINGS)
    order = GlobalOrder(len(build_samples(cfg.data, cfg.model.seq_len, 0)), cfg.data.seed)

    def digest_of_batch(index: int) -> str:
        return samples_digest(order.sample_ids(index * GLOBAL_BATCH, GLOBAL_BATCH))

    rows = jsonl(f"{run_dir}/metrics.jsonl")
    first_pass = rows[: diverged_at - 1]
    after = rows[diverged_at - 1 :]
    assert [r["step"] for r in first_pass] == list(range(1, diverged_at))
    assert [r["step"] for r in after] == list(range(restored + 1, 17))  # 9..16 trained again
    for row in first_pass:  # step s trained global batch s - 1
        assert row["samples_digest"] == digest_of_batch(row["step"] - 1), row
    for row in after:  # K batches later: the batches that led to the NaN are never seen again
        assert row["data_cursor"] == (row["step"] + skip) * GLOBAL_BATCH, row
        assert row["samples_digest"] == digest_of_batch(row["step"] - 1 + skip), row

    committed = [i.step for i in ckpt.list_checkpoints(ckpt_dir) if i.committed]
    assert committed == [16, 12, 8, 4]
    for step in committed:
        check = verify_finite(ckpt_dir, step)
        assert check.returncode == 0, check.stdout + check.stderr
    assert not os.path.exists(f"{ckpt_dir}/checkpoint_0000010")
