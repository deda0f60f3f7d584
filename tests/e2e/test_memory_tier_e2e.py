"""End-to-end: the checkpoint manager's memory tier under a real ``torchrun`` restart.

examples/bring_your_own_model.py on 2 ranks (``torchrun --standalone``, a hard deadline
per run), durable checkpoint every 6 steps, memory snapshot every step. Rank 1 is
SIGKILLed at the start of step 9; torchrun restarts both workers. The restarted ranks
must resume from the memory snapshot of step 8 (not the durable checkpoint of step 6)
and reproduce, bitwise, the losses of an uninterrupted run without the memory tier.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import uuid

import pytest

from testing.local_cluster import REPO
from testing.procs import RunTimeoutError, run_bounded

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SCRIPT = os.path.join(REPO, "examples", "bring_your_own_model.py")
RUN_TIMEOUT_S = 90
STEPS = 12
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT", "TRAINER_FAULTS", "CKPT_MEMORY_DIR")  # fmt: skip


def _run(tmp: str, name: str, memory_dir: str, *args: str) -> str:
    """One torchrun job of the example; returns its run dir."""
    run_dir = os.path.join(tmp, f"{name}_run")
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               CKPT_MEMORY_DIR=memory_dir)  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max_restarts=1", "--monitor_interval=0.5", SCRIPT,
           "--ckpt-dir", os.path.join(tmp, f"{name}_ckpt"), "--run-dir", run_dir,
           "--max-steps", str(STEPS), "--ckpt-every", "6", *args]  # fmt: skip
    try:
        proc = run_bounded(cmd, env=env, cwd=REPO, timeout_s=RUN_TIMEOUT_S)
    except RunTimeoutError as exc:
        pytest.fail(f"{name}: {exc}")
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    return run_dir


def _jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.fixture
def memory_dir():
    # tmpfs like the default /dev/shm/ckpt-memory, but private to this test.
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = os.path.join(base or "/tmp", f"ckpt-memory-e2e-{uuid.uuid4().hex[:8]}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_killed_worker_resumes_from_the_memory_snapshot_newer_than_the_durable_one(
    tmp_path, memory_dir
):
    tmp = str(tmp_path)
    base_dir = _run(tmp, "base", memory_dir)  # uninterrupted, no memory tier
    base = {r["step"]: r for r in _jsonl(os.path.join(base_dir, "metrics.jsonl"))}
    assert sorted(base) == list(range(1, STEPS + 1))

    run_dir = _run(
        tmp, "killed", memory_dir, "--memory-every", "1", "--fault", "kill:step=9:rank=1"
    )
    rows = _jsonl(os.path.join(run_dir, "metrics.jsonl"))
    events = _jsonl(os.path.join(run_dir, "events.jsonl"))
    resumes = [e for e in events if e["event"] == "resume"]
    assert [(e["step"], e["tier"], e["new_world_size"]) for e in resumes] == [(8, "memory", 2)]
    assert resumes[0]["rng_restored"] is True
    choices = [e for e in events if e["event"] == "tier_choice"]
    assert [c["tier"] for c in choices] == ["none", "memory"]  # first start, then the restart
    assert "memory step 8 newer than durable 6" in choices[1]["reason"]
    # Steps 1-8 ran once, 9-12 after the restart; every loss is bitwise the uninterrupted one.
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["restart_count"] for r in rows] == [0] * 8 + [1] * 4
    for row in rows:
        assert row["loss"] == base[row["step"]]["loss"], row["step"]
        assert row["samples_digest"] == base[row["step"]]["samples_digest"], row["step"]
    assert not [e for e in events if e["event"] == "memory_snapshot_failed"]
    # The final durable checkpoint (step 12) supersedes the memory tier: nothing left in RAM.
    assert not glob.glob(os.path.join(memory_dir, "*", "h*", "slot*")), os.listdir(memory_dir)
