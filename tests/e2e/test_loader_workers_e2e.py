"""End-to-end: preemption and restarts of jobs whose ranks have ``DataLoader`` worker processes.

Real ``torchrun`` (2 workers on one agent, gloo) running ``examples/bring_your_own_model.py
--num-workers 2`` and ``tests/e2e/scripts/ddp_loader.py`` (a user's DDP script with its own
``DataLoader``: its own process group, ``fork`` or ``spawn`` workers, persistent or not).
SIGTERM goes to torchrun, to every process group of the job, or to one worker alone, at a
step drawn at random (the seed is printed); the job must commit the emergency checkpoint of
the step it stopped at, every rank must leave through ``elastic.Preempted`` (exit 143), and
a relaunch must continue bit for bit as the uninterrupted run. Loader workers used to die of
the SIGTERM first (torchrun signals each worker's process group), which ended the job with
"DataLoader worker (pid N) is killed by signal: Terminated" and no emergency checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from test_bring_your_own_model import sigterm_to_exit_s

from testing.local_cluster import REPO, descendants
from testing.procs import TORCHRUN_CLEAN_ENV, RunTimeoutError, run_bounded

pytestmark = pytest.mark.e2e

EXAMPLE = os.path.join(REPO, "examples", "bring_your_own_model.py")
DDP_SCRIPT = os.path.join(REPO, "tests", "e2e", "scripts", "ddp_loader.py")
RDZV = {
    "c10d": ("--standalone",),
    "ft": ("--rdzv_backend=ft", "--rdzv_endpoint=127.0.0.1:0", "--nnodes=1"),
}
RUN_TIMEOUT_S = 120
EXAMPLE_STEPS = 160
DDP_STEPS = 60
DDP_STEP_SLEEP_S = 0.05
"""The DDP script's steps take ~10 ms: each sleeps this long more, so the signal lands
somewhere in the middle of the run whatever the machine's speed."""


def torchrun_cmd(script: str, args: list[str], *, rdzv: str, max_restarts: int = 0) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", *RDZV[rdzv], "--nproc_per_node=2",
        f"--max_restarts={max_restarts}", "--monitor_interval=0.5", script, *args,
    ]  # fmt: skip


def torchrun_env(rdzv: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_CLEAN_ENV}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if rdzv == "c10d":  # the README's setting for torchrun's own backend
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def run_ok(script: str, args: list[str], *, rdzv: str = "c10d", max_restarts: int = 0) -> str:
    cmd = torchrun_cmd(script, args, rdzv=rdzv, max_restarts=max_restarts)
    try:
        result = run_bounded(cmd, env=torchrun_env(rdzv), cwd=REPO, timeout_s=RUN_TIMEOUT_S)
    except RunTimeoutError as exc:
        pytest.fail(str(exc))
    assert result.returncode == 0, result.stdout[-6000:]
    return result.stdout


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def losses(run_dir: str) -> dict[int, tuple[float, str]]:
    """Step -> (loss, samples digest); a step run again after a restart keeps its last row."""
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    return {r["step"]: (r["loss"], r["samples_digest"]) for r in rows}


def preempt(
    script: str, args: list[str], run_dir: str, *, rdzv: str, target: str, seed: int, rows: tuple
) -> tuple[int, str]:
    """Start the job, wait until it has written a number of rows drawn from ``rows`` with
    ``seed``, send SIGTERM to ``target`` (``torchrun``; ``groups``: torchrun's and every
    worker's process group, as a node drain does; ``worker``: rank 1's process alone) and
    wait for the job to end. Returns torchrun's exit code and output."""
    stop_at = random.Random(seed).randint(*rows)
    print(f"seed {seed}: SIGTERM to {target} after {stop_at} rows ({rdzv})")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    out_path = os.path.join(run_dir + ".out")
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            torchrun_cmd(script, args, rdzv=rdzv), cwd=REPO, env=torchrun_env(rdzv),
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while len(read_jsonl(metrics)) < stop_at:
            assert proc.poll() is None, f"the job ended before row {stop_at}"
            assert time.monotonic() < deadline, f"no row {stop_at} after {RUN_TIMEOUT_S} s"
            time.sleep(0.01)
        workers = [p for p in descendants(proc.pid) if _parent(p) == proc.pid]
        assert len(workers) == 2, workers
        if target == "torchrun":
            os.kill(proc.pid, signal.SIGTERM)
        elif target == "groups":
            for pgid in (proc.pid, *workers):  # torchrun and each worker lead their group
                os.killpg(pgid, signal.SIGTERM)
        else:
            os.kill(max(workers), signal.SIGTERM)  # one worker alone
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            for pid in [*descendants(proc.pid), proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(10)
    with open(out_path, errors="replace") as fh:
        return code, fh.read()


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def committed(ckpt_dir: str) -> list[int]:
    return sorted(
        int(name.rsplit("_", 1)[1])
        for name in os.listdir(ckpt_dir)
        if name.startswith("checkpoint_")
        and os.path.exists(os.path.join(ckpt_dir, name, "COMPLETE"))
    )


def check_preempted(ckpt_dir: str, run_dir: str, output: str) -> int:
    """The emergency checkpoint of the step the run stopped at is committed, the ranks agreed
    on it and no loader worker died; returns that step."""
    tail = output[-4000:]
    assert "killed by signal" not in output, tail
    stopped = max(losses(run_dir))
    assert committed(ckpt_dir)[-1] == stopped, (committed(ckpt_dir), stopped, tail)
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    preempted = [(e["step"], e["emergency_save"]) for e in events if e["event"] == "preempted"]
    assert preempted == [(stopped, True)], tail
    return stopped


@pytest.fixture(scope="module")
def example_base(tmp_path_factory) -> dict[int, tuple[float, str]]:
    """The uninterrupted example run with loader workers."""
    root = tmp_path_factory.mktemp("example_base")
    args = ["--ckpt-dir", str(root / "ckpt"), "--run-dir", str(root / "run"),
            "--max-steps", str(EXAMPLE_STEPS), "--ckpt-every", "50", "--num-workers", "2"]  # fmt: skip
    run_ok(EXAMPLE, args)
    got = losses(str(root / "run"))
    assert sorted(got) == list(range(1, EXAMPLE_STEPS + 1))
    return got


@pytest.fixture(scope="module")
def ddp_base(tmp_path_factory) -> dict[int, tuple[float, str]]:
    """The uninterrupted DDP script run (its numbers do not depend on the loader's workers)."""
    root = tmp_path_factory.mktemp("ddp_base")
    args = ["--ckpt-dir", str(root / "ckpt"), "--run-dir", str(root / "run"),
            "--max-steps", str(DDP_STEPS), "--num-workers", "0"]  # fmt: skip
    run_ok(DDP_SCRIPT, args)
    got = losses(str(root / "run"))
    assert sorted(got) == list(range(1, DDP_STEPS + 1))
    return got


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rdzv", ["c10d", "ft"])
def test_example_with_loader_workers_commits_the_emergency_checkpoint_and_resumes_bitwise(
    tmp_path, example_base, rdzv
):
    ckpt_dir, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
    args = ["--ckpt-dir", ckpt_dir, "--run-dir", run_dir, "--max-steps", str(EXAMPLE_STEPS),
            "--ckpt-every", "50", "--num-workers", "2"]  # fmt: skip
    seed = random.randrange(1 << 16)
    code, output = preempt(EXAMPLE, args, run_dir, rdzv=rdzv, target="torchrun", seed=seed,
                           rows=(10, EXAMPLE_STEPS // 2))  # fmt: skip
    assert code != 0, output[-4000:]
    stopped = check_preempted(ckpt_dir, run_dir, output)
    for rank in (0, 1):  # each rank left through elastic.Preempted: exit code 143
        line = f"[rank {rank}] WARNING byom: rank {rank}: stopped by SIGTERM after step {stopped} (emergency checkpoint saved)"
        assert line in output, output[-4000:]

    run_ok(EXAMPLE, args, rdzv=rdzv)
    got = losses(run_dir)
    assert got == example_base, seed  # steps after the resume: the uninterrupted run, bitwise
    resumes = [
        e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e["event"] == "resume"
    ]
    assert [e["step"] for e in resumes] == [stopped]


DDP_CASES = [
    # start method, persistent workers, who gets SIGTERM, rendezvous backend
    ("fork", False, "torchrun", "c10d"),
    ("spawn", True, "torchrun", "ft"),
    ("spawn", False, "groups", "c10d"),
    ("fork", True, "worker", "ft"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("start", "persistent", "target", "rdzv"), DDP_CASES)
def test_user_dataloader_commits_the_emergency_checkpoint_and_resumes_bitwise(
    tmp_path, ddp_base, start, persistent, target, rdzv
):
    ckpt_dir, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
    args = ["--ckpt-dir", ckpt_dir, "--run-dir", run_dir, "--max-steps", str(DDP_STEPS),
            "--num-workers", "2", "--start-method", start]  # fmt: skip
    if persistent:
        args.append("--persistent")
    seed = random.randrange(1 << 16)
    code, output = preempt(
        DDP_SCRIPT, [*args, "--step-sleep", str(DDP_STEP_SLEEP_S)], run_dir, rdzv=rdzv,
        target=target, seed=seed, rows=(5, DDP_STEPS // 2),
    )  # fmt: skip
    assert code != 0, output[-4000:]
    stopped = check_preempted(ckpt_dir, run_dir, output)
    exits = {r: read_jsonl(os.path.join(run_dir, f"exit.rank{r}.json")) for r in (0, 1)}
    assert exits == {r: [{"code": 143, "step": stopped}] for r in (0, 1)}, output[-4000:]

    run_ok(DDP_SCRIPT, args, rdzv=rdzv)
    assert losses(run_dir) == ddp_base, seed


@pytest.mark.timeout(300)
def test_user_dataloader_survivor_leaves_at_once_after_a_peer_is_killed(tmp_path, ddp_base):
    """A rank of the DDP script (own process group, no elastic.init_distributed) killed with
    one loader worker per rank: its loader worker used to keep its gloo connections open
    until it noticed its parent was gone (5 s), and torchrun waited that long for the
    survivor after its SIGTERM (5.6 s measured). The guard makes forked children release
    them; the survivor leaves at once and the run matches."""
    ckpt_dir, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
    args = ["--ckpt-dir", ckpt_dir, "--run-dir", run_dir, "--max-steps", str(DDP_STEPS),
            "--num-workers", "1", "--fault", "kill:step=25:rank=1"]  # fmt: skip
    output = run_ok(DDP_SCRIPT, args, max_restarts=1)
    assert losses(run_dir) == ddp_base
    waited = sigterm_to_exit_s(output)
    print(
        f"loader workers, own process group: torchrun's SIGTERM -> survivor gone in {waited:.2f} s"
    )
    assert waited < 3.0, output[-4000:]  # 5 s and more when the gloo sockets stay open
