"""Bounded storage by default: a long run keeps what the retention policy says, and a
kill at any point of a prune never leaves a torn checkpoint.

1. ``python -m trainer`` under torchrun (2 ranks), 300 steps, a checkpoint every 10,
   ``keep_last=3`` (the default) and ``keep_every=100``, a worker SIGKILLed at step
   155 and the group restarted: the root ends with exactly 100, 200, 280, 290 and 300,
   and every loss equals an uninterrupted run's. On a local root and on the GCS
   emulator.
2. A prune (``apply_retention``) run in a subprocess that SIGKILLs itself at each of its
   storage deletes in turn, also half-way through deleting a directory: afterwards
   every directory discovery calls committed loads and verifies, the newest is
   untouched, and the next prune leaves exactly what the policy keeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import ckpt
from ckpt.root.retention import apply_retention
from testing.local_cluster import REPO
from testing.procs import RunTimeoutError, torchrun_trainer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

TINY = [
    "--config", "examples/tiny_gpt.toml", "--max-steps", "300", "--ckpt-every", "10",
    "--set", "model.d_model=16", "--set", "model.n_head=2", "--set", "model.n_layer=1",
    "--set", "model.seq_len=16", "--set", "data.corpus_chars=20000",
    "--set", "data.global_batch=4", "--set", "data.micro_batch=2", "--set", "run.log_every=100",
    "--set", "checkpoint.keep_every=100",
]  # fmt: skip
KEPT = [100, 200, 280, 290, 300]


def train(ckpt_dir: str, run_dir: str, *extra: str, max_restarts: int = 0) -> None:
    try:
        result = torchrun_trainer(
            [*TINY, *extra, "--ckpt-dir", ckpt_dir, "--run-dir", run_dir],
            cwd=REPO,
            max_restarts=max_restarts,
            timeout_s=150,
        )
    except RunTimeoutError as exc:
        pytest.fail(str(exc))
    assert result.returncode == 0, result.stdout[-6000:]


def losses(run_dir: str) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return {r["step"]: r["loss"] for r in rows}  # the re-run steps' rows overwrite


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict[int, float]:
    root = tmp_path_factory.mktemp("retention_base")
    train(str(root / "ckpt"), str(root / "run"))
    return losses(str(root / "run"))


@pytest.fixture(params=["local", "gcs"])
def root(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return request.getfixturevalue("gcs_root")


def test_a_300_step_run_with_a_kill_keeps_what_the_policy_says(root, baseline, tmp_path):
    run_dir = str(tmp_path / "run")
    train(root, run_dir, "--fault", "kill:step=155:rank=1", max_restarts=1)
    assert [i.step for i in ckpt.list_checkpoints(root) if i.committed] == sorted(
        KEPT, reverse=True
    )
    assert [i.step for i in ckpt.list_checkpoints(root)] == sorted(KEPT, reverse=True)
    got = losses(run_dir)
    assert sorted(got) == list(range(1, 301))
    for step in range(1, 301):
        assert got[step] == baseline[step], step
    with open(os.path.join(run_dir, "events.jsonl")) as fh:
        resumes = [json.loads(line) for line in fh if '"resume"' in line]
    assert [r["step"] for r in resumes] == [150]


PRUNE = textwrap.dedent(
    """
    import os, signal, sys
    import ckpt
    from ckpt.root.retention import apply_retention
    from ckpt.storage import Storage

    root, kill_at, half = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "half"
    calls = [0]
    real_remove, real_tree = Storage.remove, Storage.remove_tree

    def maybe_die():
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def remove(self, key):
        maybe_die()
        real_remove(self, key)

    def remove_tree(self, key):
        if half:  # delete one file of the directory, then die half-way through it
            files = sorted(self.list_files(key))
            if files and calls[0] + 1 == kill_at:
                real_remove(self, f"{key}/{files[len(files) // 2]}")
        maybe_die()
        real_tree(self, key)

    Storage.remove, Storage.remove_tree = remove, remove_tree
    apply_retention(root, ckpt.RetentionPolicy(keep_last=2, keep_every=4))
    print("finished")
    """
)


@pytest.mark.parametrize("half", ["whole", "half"])
def test_a_kill_at_any_point_of_a_prune_leaves_no_torn_checkpoint(tmp_path, root, half):
    import torch

    script = tmp_path / "prune.py"
    script.write_text(PRUNE)
    states = {step: {"w": torch.full((64,), float(step)), "step": step} for step in range(1, 8)}
    # 7 committed: the policy keeps 7, 6 (newest 2) and 4; deletes 5, 3, 2, 1
    # (2 storage calls each: COMPLETE, then the tree).
    for kill_at in range(1, 9):
        case = f"{root}/kill{kill_at}"
        for step in range(1, 8):
            ckpt.save(states[step], case, step)
        env = {**os.environ, "PYTHONPATH": REPO}
        proc = subprocess.run(
            [sys.executable, str(script), case, str(kill_at), half],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == -9, (kill_at, proc.stdout, proc.stderr)
        committed = [i.step for i in ckpt.list_checkpoints(case) if i.committed]
        assert {7, 6, 4} <= set(committed), (kill_at, committed)
        for step in committed:  # whatever discovery calls committed is whole
            loaded = {"w": torch.zeros(64), "step": -1}
            assert ckpt.load(loaded, case, step=step).step == step
            assert torch.equal(loaded["w"], states[step]["w"]), (kill_at, step)
        loaded = {"w": torch.zeros(64), "step": -1}
        assert ckpt.load(loaded, case).step == 7
        apply_retention(case, ckpt.RetentionPolicy(keep_last=2, keep_every=4))
        assert [i.step for i in ckpt.list_checkpoints(case)] == [7, 6, 4], kill_at
