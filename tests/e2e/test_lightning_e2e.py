"""End-to-end: examples/lightning_fit.py, a ``pl.Trainer`` with ``ElasticCheckpoints``, under torchrun.

Real Lightning (``pytorch_lightning``) on real ``torchrun --standalone`` processes, each
with a hard deadline. The example's rank 0 appends each step's loss (summed over the
ranks) to metrics.jsonl; a step trained again after a restart keeps its last row.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from testing.local_cluster import REPO
from testing.procs import copy_root_until, run_example, step_rows

pytestmark = pytest.mark.e2e

SCRIPT = os.path.join(REPO, "examples", "lightning_fit.py")
RUN_TIMEOUT_S = 150
STEPS = 12
CROSS_WORLD_REL = 1e-5
"""Another world size sums the same samples' losses in another order: float32 rounding
(observed <= 1e-7 relative over 8 steps); a wrong sample or a lost optimizer state moves
a step's loss by percents."""


def run(nproc: int, ckpt_dir: str, run_dir: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """The example under ``torchrun --standalone`` (bounded), which may fail."""
    return run_example(SCRIPT, ckpt_dir, run_dir, *args, nproc=nproc,
                       timeout_s=RUN_TIMEOUT_S, must_pass=False, **kwargs)  # fmt: skip


def launch(nproc: int, ckpt_dir: str, run_dir: str, *args: str, **kwargs) -> str:
    """The example under ``torchrun --standalone`` (bounded), which must exit 0; its output."""
    return run_example(SCRIPT, ckpt_dir, run_dir, *args, nproc=nproc,
                       timeout_s=RUN_TIMEOUT_S, **kwargs).stdout  # fmt: skip


losses = step_rows


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lightning")


_RUNS: dict[str, dict[int, dict]] = {}


def uninterrupted(root, name: str, strategy: str, *args: str, steps: int = STEPS) -> dict[int, dict]:
    """A 2-rank fit with no fault (once per name in this module)."""
    if name not in _RUNS:
        run_dir = str(root / f"{name}_run")
        launch(2, str(root / f"{name}_ckpt"), run_dir, "--max-steps", str(steps),
               "--strategy", strategy, *args)  # fmt: skip
        rows = losses(run_dir)
        assert sorted(rows) == list(range(1, steps + 1))
        _RUNS[name] = rows
    return _RUNS[name]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_killed_rank_restarts_and_the_fit_matches_an_uninterrupted_one_bitwise(root, strategy):
    """Rank 1 SIGKILLed before step 9 (the fault fired by the callback's guard); torchrun
    restarts both ranks, the callback resumes step 8 (model, AdamW, StepLR, Lightning's
    loop, the sampler, each rank's dropout RNG) and every loss equals the uninterrupted fit's."""
    base = uninterrupted(root, f"base_{strategy}", strategy)
    ckpt_dir, run_dir = str(root / f"killed_{strategy}_ckpt"), str(root / f"killed_{strategy}_run")
    out = launch(2, ckpt_dir, run_dir, "--max-steps", str(STEPS), "--strategy", strategy,
                 "--fault", "kill:step=9:rank=1", max_restarts=1)  # fmt: skip
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert {s: r["loss"] for s, r in got.items()} == {s: r["loss"] for s, r in base.items()}
    assert [got[s]["restart_count"] for s in range(9, STEPS + 1)] == [1] * 4
    assert "resumed step 8 from" in out and "world size 2 -> 2, RNG restored" in out, out[-4000:]
    assert "exitcode: -9" in out  # the kill happened
    assert sorted(os.listdir(ckpt_dir))[-1] == f"checkpoint_{STEPS:07d}"


@pytest.mark.timeout(400)
def test_a_sigterm_commits_an_emergency_checkpoint_and_a_relaunch_continues_bitwise(root):
    """SIGTERM on every rank before step 7 (the guard's handler, not Lightning's): the ranks
    agree, commit step 6 (not a periodic step) and exit 143; a new launch resumes step 6
    and every loss equals the uninterrupted fit's."""
    base = uninterrupted(root, "base_ddp", "ddp")
    ckpt_dir, run_dir = str(root / "sigterm_ckpt"), str(root / "sigterm_run")
    first = run(2, ckpt_dir, run_dir, "--max-steps", str(STEPS), "--fault", "sigterm:step=7")
    assert first.returncode != 0 and "exitcode  : 143" in first.stdout, first.stdout[-4000:]
    assert "emergency checkpoint committed at step 6" in first.stdout
    assert "Received SIGTERM" not in first.stdout  # Lightning's handler did not run
    assert sorted(os.listdir(ckpt_dir)) == ["checkpoint_0000004", "checkpoint_0000006"]
    out = launch(2, ckpt_dir, run_dir, "--max-steps", str(STEPS))
    assert "resumed step 6 from" in out
    assert {s: r["loss"] for s, r in losses(run_dir).items()} == {
        s: r["loss"] for s, r in base.items()
    }


@pytest.mark.timeout(400)
def test_an_fsdp2_fit_of_two_ranks_resumes_on_one(root):
    """2 -> 1 ranks: the FSDP2 checkpoint of step 12 (of a 20-step fit on 2 ranks) resumed by
    one rank, which trains steps 13-20 on the same samples: each loss equals the 2-rank
    fit's up to float rounding (no dropout: no per-rank randomness)."""
    steps = 20
    base = uninterrupted(root, "no_dropout", "fsdp2", "--dropout", "0", steps=steps)
    ckpt_dir = root / "two_to_one_ckpt"
    copy_root_until(str(root / "no_dropout_ckpt"), str(ckpt_dir), 12)
    run_dir = str(root / "two_to_one_run")
    out = launch(1, str(ckpt_dir), run_dir, "--max-steps", str(steps), "--strategy", "fsdp2",
                 "--dropout", "0")  # fmt: skip
    assert "resumed step 12 from" in out and "world size 2 -> 1" in out, out[-4000:]
    got = losses(run_dir)
    assert sorted(got) == list(range(13, steps + 1))
    assert {r["world_size"] for r in got.values()} == {1}
    for step, row in got.items():
        assert row["loss"] == pytest.approx(base[step]["loss"], rel=CROSS_WORLD_REL), step
