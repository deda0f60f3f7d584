"""End-to-end: a user's FSDP2 CNN with BatchNorm and dropout under a worker kill.

``tests/e2e/scripts/cnn_batchnorm.py`` (public API only) under torchrun, 2 ranks: an
uninterrupted run and a run whose rank 1 is SIGKILLed at step 9 and restarted by
torchrun. Every tensor each rank holds at the end - local parameter shards, BatchNorm
running statistics (different on each rank), optimizer state - is bitwise equal. Then
the same checkpoints resume on 1 rank: the documented rule is said, naming the buffers.
"""

from __future__ import annotations

import os

import pytest
import torch

from testing.local_cluster import REPO
from testing.procs import RunTimeoutError, torchrun_trainer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCRIPT = os.path.join(REPO, "tests", "e2e", "scripts", "cnn_batchnorm.py")


def run(root: str, run_dir: str, steps: int, *fault: str, nproc: int = 2, restarts: int = 0):
    try:
        result = torchrun_trainer(
            [root, run_dir, str(steps), *fault],
            cwd=REPO,
            nproc=nproc,
            max_restarts=restarts,
            timeout_s=150,
            program=(SCRIPT,),
        )
    except RunTimeoutError as exc:
        pytest.fail(str(exc))
    assert result.returncode == 0, result.stdout[-6000:]
    return result


def held(run_dir: str, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(run_dir, f"state.rank{rank}.pt"), weights_only=True)


def test_every_rank_resumes_its_own_state_bitwise_after_a_worker_kill(tmp_path):
    base, killed = str(tmp_path / "base"), str(tmp_path / "killed")
    run(f"{base}/ckpt", f"{base}/run", 12)
    result = run(f"{killed}/ckpt", f"{killed}/run", 12, "kill:step=9:rank=1", restarts=1)
    assert "resumed step 8" in result.stdout, result.stdout[-4000:]
    stats = "model.1.running_mean"
    expected = [held(f"{base}/run", r) for r in (0, 1)]
    assert not torch.equal(expected[0][stats], expected[1][stats])  # per rank by nature
    for rank in (0, 1):
        got = held(f"{killed}/run", rank)
        assert got.keys() == expected[rank].keys()
        for name, tensor in expected[rank].items():
            assert torch.equal(got[name], tensor), (rank, name)

    # 2 -> 1 rank: rank 0 takes saved rank 0's statistics, and says so.
    alone = run(f"{killed}/ckpt", f"{killed}/run1", 14, nproc=1)
    assert "per-rank state" in alone.stdout and "1.running_mean" in alone.stdout, alone.stdout[
        -4000:
    ]
    assert "r % 2" in alone.stdout
