"""End-to-end: the trainer under real torchrun agents, with failures injected.

Each scenario launches agents with ``--nnodes=2:4 --nproc_per_node=1`` on one
rendezvous (see testing/local_cluster.py) and asserts on the run's outputs: metrics.jsonl,
events.jsonl and checkpoint files. Every scenario is bounded; the harness kills
only the processes it started.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import ckpt
from bench.fault_cost import fault_cost
from runcore import events as ev
from testing.local_cluster import BACKENDS, REPO, ElasticJob
from testing.procs import MICRO_BATCH

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

STEPS = 24
EVERY = 6
TRAINER_ARGS = [
    "--config", "examples/tiny_gpt.toml",
    "--max-steps", str(STEPS), "--ckpt-every", str(EVERY),
    "--set", "run.save_final=true", "--set", "run.log_every=1",
    "--set", "data.corpus_chars=20000", "--set", "run.watchdog_s=15",
    "--set", MICRO_BATCH,
]  # fmt: skip
FINAL_PARAMS = "final_params.pt"


def by_step(rows: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for row in rows:
        out.setdefault(row["step"], []).append(row)
    return out


def final_params(run_dir: str) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(run_dir, FINAL_PARAMS), weights_only=True)


def assert_completed(job: ElasticJob, steps: int = STEPS) -> None:
    rows = job.metrics()
    assert rows and rows[-1]["step"] == steps, job.logs_tail()
    assert {e["event"] for e in job.events()} >= {"finished"}


def assert_repeated_steps_saw_same_samples(rows: list[dict]) -> None:
    """Steps run twice (before a failure and after the resume) consumed the same global samples."""
    repeated = 0
    for step, seen in by_step(rows).items():
        digests = {r["samples_digest"] for r in seen}
        assert len(digests) == 1, f"step {step} consumed different samples across attempts: {seen}"
        cursors = {r["data_cursor"] for r in seen}
        assert len(cursors) == 1, f"step {step}: data cursor differs across attempts: {seen}"
        repeated += len(seen) > 1
    return repeated


def run_two_agents(job: ElasticJob, timeout_s: float) -> None:
    """Start two agents on ``job`` and require both to finish with exit code 0."""
    job.add_agent()
    job.add_agent()
    assert job.wait_agents(timeout_s) == {"agent0": 0, "agent1": 0}, job.logs_tail()


def assert_bitwise_like(reference: ElasticJob, job: ElasticJob) -> None:
    """Every row's loss (repeated steps included) and the final parameters of ``job`` equal,
    bit for bit, those of the uninterrupted ``reference``."""
    ref_losses = {r["step"]: r["loss"] for r in reference.metrics()}
    for r in job.metrics():
        assert r["loss"] == ref_losses[r["step"]], r
    ref, got = final_params(reference.run_dir), final_params(job.run_dir)
    assert set(ref) == set(got)
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


@pytest.fixture
def job_factory(tmp_path):
    jobs: list[ElasticJob] = []

    def make(name: str, **kwargs) -> ElasticJob:
        job = ElasticJob(workdir=str(tmp_path / name), trainer_args=list(TRAINER_ARGS), **kwargs)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_worker_killed_group_restarts_and_matches_uninterrupted_run(
    job_factory, reference_run, backend
):
    # --nnodes=2:3 --max_restarts=2 on either rendezvous backend; with ft no
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE anywhere (ElasticJob sets it for c10d only).
    settings = {"rdzv_backend": backend, "nnodes": "2:3", "max_restarts": 2}
    job = job_factory("killed", rdzv_id="killed", **settings)
    job.env["TRAINER_FAULTS"] = "kill:step=14:rank=1"
    run_two_agents(job, 180)
    assert_completed(job)
    rows = job.metrics()
    assert max(r["restart_count"] for r in rows) == 1
    loaded = [e for e in job.events() if e["event"] in ("checkpoint_loaded", "resume")]
    assert any(e.get("step") == 12 for e in loaded), loaded
    assert (
        any(e["event"] == "fault" for e in job.events()) or rows
    )  # the fault event may die with the rank
    assert_bitwise_like(reference_run, job)
    logs = [a.log() for a in job.agents]
    assert not any("is not set in its environment" in text for text in logs)  # RunGuard's warning
    cost = fault_cost(rows, job.all_events(), logs, kills=1)
    kill = cost["per_kill"][0]
    print(
        f"\n[{backend}] kill -> first step after: downtime_s={kill['downtime_s']:.2f}",
        {k: round(v, 2) for k, v in kill.items() if k.endswith("_s")},
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_agent_killed_survivors_finish_resharded(job_factory, backend):
    job = job_factory("lost", rdzv_backend=backend)
    agents = [job.add_agent() for _ in range(3)]
    job.wait_for(
        lambda: job.last_step() >= 14 and job.metrics()[-1]["world_size"] == 3,
        150,
        "step 14 at world 3",
    )
    job.kill_node(agents[2])
    codes = job.wait_agents(180, agents[:2])
    assert codes == {"agent0": 0, "agent1": 0}, job.logs_tail()
    assert_completed(job)
    rows = job.metrics()
    sizes = [r["world_size"] for r in rows]
    assert sizes[0] == 3 and sizes[-1] == 2
    assert assert_repeated_steps_saw_same_samples(rows) >= 1
    last = ckpt.find_latest_committed(job.ckpt_dir)
    assert last.step == STEPS and last.manifest.world_size == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_agent_joins_job_continues_at_world_size_3(job_factory, backend):
    steps = 100  # long enough that the newcomer's torchrun starts before the job ends
    job = job_factory("join", rdzv_backend=backend)
    job.trainer_args[job.trainer_args.index(str(STEPS))] = str(steps)
    job.trainer_args[job.trainer_args.index(MICRO_BATCH)] = "data.micro_batch=2"  # longer steps
    job.add_agent()
    job.add_agent()
    job.wait_for(lambda: job.last_step() >= 4, 150, "step 4 at world 2")
    job.add_agent()
    assert job.wait_agents(200) == {"agent0": 0, "agent1": 0, "agent2": 0}, job.logs_tail()
    assert_completed(job, steps)
    rows = job.metrics()
    assert rows[0]["world_size"] == 2 and rows[-1]["world_size"] == 3
    assert_repeated_steps_saw_same_samples(rows)
    assert ckpt.find_latest_committed(job.ckpt_dir).manifest.world_size == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_hung_rank_is_ended_by_the_watchdog_and_the_job_finishes(job_factory, backend):
    job = job_factory("hang", rdzv_backend=backend)
    job.env["TRAINER_FAULTS"] = "hang:step=14:rank=1"
    job.trainer_args[job.trainer_args.index("run.watchdog_s=15")] = "run.watchdog_s=6"
    run_two_agents(job, 200)
    assert_completed(job)
    assert max(r["restart_count"] for r in job.metrics()) == 1
    dumps = [f for f in os.listdir(job.run_dir) if f.startswith("stacks_")]
    assert dumps, os.listdir(job.run_dir)
    with open(os.path.join(job.run_dir, dumps[0])) as f:
        assert "hang" in f.read()


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_restarts_exhausted_fails_clearly_and_last_checkpoint_verifies(job_factory, backend):
    job = job_factory("exhausted", max_restarts=1, rdzv_backend=backend)
    job.env["TRAINER_FAULTS"] = "exit:step=9:rank=0:attempt=0;exit:step=9:rank=0:attempt=1"
    job.add_agent()
    job.add_agent()
    codes = job.wait_agents(200)
    assert all(code != 0 for code in codes.values()), (codes, job.logs_tail())
    logs = job.logs_tail(20000)
    assert "trainer" in logs and ("ChildFailedError" in logs or "failed" in logs)
    last = ckpt.find_latest_committed(job.ckpt_dir)
    assert last is not None and last.step == EVERY
    verify = subprocess.run(
        [sys.executable, "-m", "ckpt", "verify", "--deep", job.ckpt_dir],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigterm_emergency_checkpoint_then_new_launch_resumes(job_factory, backend):
    # The agent left alone gives up after its join timeout (15 s, not 60: nothing joins).
    job = job_factory("preempt", rdzv_backend=backend, join_timeout_s=15)
    agents = [job.add_agent(), job.add_agent()]
    job.wait_for(lambda: job.last_step() >= 8, 150, "step 8")
    job.sigterm_agent(agents[1])
    job.wait_agents(90)
    events = job.events()
    preempt = [e for e in events if e["event"].startswith("preempt")]
    assert preempt, events
    emergency = [e for e in events if e["event"] == "checkpoint_saved" and e.get("emergency")]
    last = ckpt.find_latest_committed(job.ckpt_dir)
    if emergency:
        assert last.step == emergency[-1]["step"]
        assert last.step % EVERY != 0 or last.step >= 8
    stopped_at = job.last_step()
    assert stopped_at < STEPS

    # A new launch of the same job: same checkpoints and run dir.
    again = job_factory(
        "preempt-resume", rdzv_id="preempt2", data_dir=job.workdir, rdzv_backend=backend
    )
    run_two_agents(again, 180)
    resumed = [e for e in again.events() if e["event"] in ("checkpoint_loaded", "resume")]
    assert any(e.get("step") == last.step for e in resumed), resumed
    assert again.metrics()[-1]["step"] == STEPS


CHAOS_KILLS = 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_chaos_random_worker_kills_resume_bitwise(job_factory, reference_run, backend):
    """SIGKILL of a random worker at a random moment (mid-step, mid-save, mid-load: wherever
    it lands), three times, each in the attempt after the last one; the job must finish and
    equal the uninterrupted run bit for bit. The seed is printed; ``CHAOS_SEED`` replays it."""
    seed = int(os.environ.get("CHAOS_SEED", time.time_ns() % 1_000_000))
    print(f"\n[{backend}] CHAOS_SEED={seed}")
    rng = random.Random(seed)
    job = job_factory(
        "chaos", rdzv_id="chaos", rdzv_backend=backend, nnodes="2:3", max_restarts=CHAOS_KILLS + 1
    )
    agents = [job.add_agent(), job.add_agent()]
    kills: list[tuple[str, int]] = []
    killed_at = 0.0
    for attempt in range(CHAOS_KILLS):
        # A step finished after the last kill: the next attempt runs. Kill early enough
        # that it is still running (it resumed from a checkpoint up to 6 steps back).
        after = rng.randint(2, STEPS // 2 + 2)
        job.wait_for(
            lambda s=after, t=killed_at: (
                (rows := job.metrics()) and rows[-1]["time"] > t and rows[-1]["step"] >= s
            ),
            150,
            f"attempt {attempt} past step {after}",
        )
        time.sleep(rng.uniform(0.0, 0.4))  # off the step boundary
        victim = rng.choice(agents)
        workers = job.worker_pids(victim)
        assert workers, f"{victim.name} has no worker to kill"
        os.kill(workers[0], signal.SIGKILL)
        killed_at = time.time()
        kills.append((victim.name, job.last_step()))
    assert job.wait_agents(200) == {"agent0": 0, "agent1": 0}, (seed, kills, job.logs_tail())
    assert_completed(job)
    rows = job.metrics()
    starts = [e for e in job.events() if e["event"] == ev.START]
    assert len(starts) == CHAOS_KILLS + 1, (seed, kills, starts)  # one group per attempt
    assert_repeated_steps_saw_same_samples(rows)
    assert_bitwise_like(reference_run, job)
    print(f"[{backend}] kills (agent, last step seen): {kills}")


def test_a_rank_that_holds_the_gil_for_10_s_is_waited_for_not_removed(job_factory, reference_run):
    """On ft, rank 1 holds the GIL for 10 s at step 12, as a full garbage collection of a
    large heap does: its heartbeat stops for twice the peer bound, but its node's
    keep-alive (its agent's) goes on. Rank 0 says the stall (``peer_stalled``, at WARNING)
    and waits; nobody is removed, nothing restarts, and the run equals the uninterrupted
    one bit for bit."""
    job = job_factory("stall", rdzv_id="stall", rdzv_backend="ft")
    job.env["TRAINER_FAULTS"] = "stall:step=12:rank=1:seconds=10"
    run_two_agents(job, 180)
    assert_completed(job)
    rows = job.metrics()
    assert max(r["restart_count"] for r in rows) == 0, rows
    events = job.all_events()
    assert not [e for e in events if e["event"] == ev.PEER_SILENT], events
    stalled = [e for e in events if e["event"] == ev.PEER_STALLED]
    assert stalled and all(e["stalled_rank"] == 1 and e["rank"] == 0 for e in stalled), stalled
    assert all(e["stalled_s"] > 5.0 and e["limit_s"] == 60.0 for e in stalled), stalled
    logs = "\n".join(a.log() for a in job.agents)
    assert "is alive: its process is stalled" in logs  # rank 0's WARNING
    assert "heartbeat threads did not run for" in logs  # rank 1's own, after the stall
    assert_bitwise_like(reference_run, job)
