"""End-to-end: examples/hf_trainer_fit.py, a ``transformers.Trainer`` with ``ElasticCheckpoints``.

A tiny ``LlamaForCausalLM`` (tied embeddings, AdamW, cosine schedule with warm-up) trained
by the real Trainer (DDP through accelerate, gloo) under real ``torchrun --standalone``,
each run with a hard deadline. The example's rank 0 appends the Trainer's logged loss (the
mean over ranks) of every step to metrics.jsonl; a step trained again after a restart
keeps its last row.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaForCausalLM

from testing.local_cluster import REPO
from testing.procs import copy_root_until, run_example, step_rows

pytestmark = pytest.mark.e2e

SCRIPT = os.path.join(REPO, "examples", "hf_trainer_fit.py")
RUN_TIMEOUT_S = 150
STEPS = 20
CROSS_WORLD_REL = 1e-5
"""Another world size sums the same tokens' losses in another order: float32 rounding
(observed <= 1.2e-7 relative over 20 steps); a wrong sample or a lost optimizer state
moves a step's loss by far more."""


def run(nproc: int, ckpt_dir: str, run_dir: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """The example under ``torchrun --standalone`` (bounded), which may fail."""
    return run_example(SCRIPT, ckpt_dir, run_dir, "--max-steps", str(STEPS), *args, nproc=nproc,
                       timeout_s=RUN_TIMEOUT_S, must_pass=False, **kwargs)  # fmt: skip


def launch(nproc: int, ckpt_dir: str, run_dir: str, *args: str, **kwargs) -> str:
    """The example under ``torchrun --standalone`` (bounded), which must exit 0; its output."""
    return run_example(SCRIPT, ckpt_dir, run_dir, "--max-steps", str(STEPS), *args, nproc=nproc,
                       timeout_s=RUN_TIMEOUT_S, **kwargs).stdout  # fmt: skip


losses = step_rows


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_trainer")


@pytest.fixture(scope="module")
def base(root) -> dict[int, dict]:
    """The uninterrupted 2-rank run: 20 steps, a checkpoint every 4."""
    launch(2, str(root / "base_ckpt"), str(root / "base_run"))
    rows = losses(str(root / "base_run"))
    assert sorted(rows) == list(range(1, STEPS + 1))
    return rows


def export(root_dir, out) -> LlamaForCausalLM:
    """``python -m ckpt export`` of the newest checkpoint, loaded by ``from_pretrained``."""
    subprocess.run([sys.executable, "-m", "ckpt", "export", str(root_dir), str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=120)  # fmt: skip
    return LlamaForCausalLM.from_pretrained(str(out))


@pytest.mark.timeout(400)
def test_a_killed_rank_restarts_and_the_run_matches_an_uninterrupted_one_bitwise(root, base):
    """Rank 1 SIGKILLed before step 10; torchrun restarts both ranks, the callback resumes
    step 8 (model, AdamW, the cosine schedule, the Trainer's step, the sampler, the RNG):
    every loss equals the uninterrupted run's, and the exported models are equal."""
    ckpt_dir, run_dir = root / "killed_ckpt", str(root / "killed_run")
    out = launch(2, str(ckpt_dir), run_dir, "--fault", "kill:step=10:rank=1", max_restarts=1)
    assert "exitcode: -9" in out and "resumed step 8 from" in out, out[-4000:]
    got = losses(run_dir)
    assert {s: r["loss"] for s, r in got.items()} == {s: r["loss"] for s, r in base.items()}
    assert [got[s]["restart_count"] for s in range(9, STEPS + 1)] == [1] * 12
    ours, theirs = export(ckpt_dir, root / "killed_hf"), export(root / "base_ckpt", root / "base_hf")
    assert ours.config.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight
    mine, reference = ours.state_dict(), theirs.state_dict()
    assert sorted(mine) == sorted(reference)
    for name, tensor in mine.items():
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.timeout(400)
def test_a_two_rank_checkpoint_resumes_on_one_with_the_same_samples(root, base):
    """2 -> 1: the checkpoint of step 12 resumed by one process, which trains steps 13-20
    with the whole global batch: each loss equals the 2-rank run's up to float rounding."""
    ckpt_dir = root / "two_to_one_ckpt"
    copy_root_until(str(root / "base_ckpt"), str(ckpt_dir), 12)
    run_dir = str(root / "two_to_one_run")
    out = launch(1, str(ckpt_dir), run_dir)
    assert "resumed step 12 from" in out and "world size 2 -> 1" in out, out[-4000:]
    got = losses(run_dir)
    assert sorted(got) == list(range(13, STEPS + 1))
    assert {r["world_size"] for r in got.values()} == {1}
    for step, row in got.items():
        assert row["loss"] == pytest.approx(base[step]["loss"], rel=CROSS_WORLD_REL), step
