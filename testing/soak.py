"""A random-kill soak: SIGKILLs of random workers at random moments, start-up included.

    python -m testing.soak --backend ft --seeds 1,2,3 [--warm] [--memory] [--kills 10]

For each seed: one job of two torchrun agents (``--nnodes=2:4``, one worker each,
``testing.local_cluster.ElasticJob``) running the trainer; ``--kills`` times a random
worker is SIGKILLed, each time in a new attempt, at a random moment: while it trains
(after a row newer than the last kill), or during its start-up (a random delay after the
attempt's worker processes appear: imports, ``init_process_group``, model build, the
checkpoint group, resume). The job must finish with every row's loss and the final
parameters equal, bit for bit, to one uninterrupted run of the same arguments. ``--warm``
launches through ``-m warmstart``; ``--memory`` turns the memory tier on (a snapshot
every 2 steps, each agent a node of its own). One line per run (seed, backend, launcher,
tiers, kills at start-up / while training, outcome, wall time) on stdout, and a JSON list
with ``--json``. Not part of the test suite: a run takes a minute or two.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from testing.local_cluster import BACKENDS, ElasticJob

STEPS = 60
TRAINER_ARGS = [
    "--config", "examples/tiny_gpt.toml", "--max-steps", str(STEPS), "--ckpt-every", "6",
    "--set", "run.save_final=true", "--set", "run.log_every=10",
    "--set", "data.corpus_chars=20000", "--set", "run.watchdog_s=30",
]  # fmt: skip
JOB_TIMEOUT_S = 600.0


@dataclass
class SoakRun:
    seed: int
    backend: str
    warm: bool
    memory: bool
    kills_at_startup: int = 0
    kills_training: int = 0
    outcome: str = "not run"
    wall_s: float = 0.0
    restarts: int = 0
    max_survivor_wait_s: float | None = None
    """The longest, over the kills, from a kill to the other agent stopping its worker or
    seeing it fail (its torchrun log)."""
    notes: list[str] = field(default_factory=list)


def _launch(trainer_args: list[str], warm: bool) -> tuple[str, list[str]]:
    return ("warmstart", ["-m", "trainer", *trainer_args]) if warm else ("trainer", trainer_args)


def _job(work: str, name: str, backend: str, warm: bool, memory: bool, restarts: int) -> ElasticJob:
    args = list(TRAINER_ARGS) + (["--set", "checkpoint.memory_every=2"] if memory else [])
    module, program = _launch(args, warm)
    return ElasticJob(
        workdir=os.path.join(work, name), trainer_args=program, module=module,
        rdzv_id=name, rdzv_backend=backend, nnodes="2:4", max_restarts=restarts,
    )  # fmt: skip


def _add_agents(job: ElasticJob, memory_root: str | None) -> None:
    for i in range(2):
        env = {"CKPT_MEMORY_DIR": os.path.join(memory_root, f"node{i}")} if memory_root else {}
        job.add_agent(env=env)


def reference(work: str, backend: str) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """Losses by step and final parameters of the uninterrupted run."""
    job = _job(work, "reference", backend, warm=False, memory=False, restarts=0)
    try:
        _add_agents(job, None)
        codes = job.wait_agents(JOB_TIMEOUT_S)
        if any(codes.values()):
            raise RuntimeError(f"the reference run failed: {codes}\n{job.logs_tail()}")
        losses = {r["step"]: r["loss"] for r in job.metrics()}
        params = torch.load(os.path.join(job.run_dir, "final_params.pt"), weights_only=True)
        return losses, params
    finally:
        job.close()


def soak_once(
    work: str, run: SoakRun, kills: int, ref: tuple[dict[int, float], dict[str, torch.Tensor]]
) -> SoakRun:
    rng = random.Random(run.seed)
    name = f"soak-{run.backend}-{run.seed}-{'warm' if run.warm else 'cold'}"
    memory_root = tempfile.mkdtemp(prefix="soak-mem-", dir="/dev/shm") if run.memory else None
    job = _job(work, name, run.backend, run.warm, run.memory, restarts=kills + 4)
    started = time.monotonic()
    try:
        _add_agents(job, memory_root)
        killed: set[int] = set()
        kill_times: list[tuple[float, str]] = []
        last_kill = 0.0
        for _ in range(3 * kills):  # a victim may be gone already (its peer was killed)
            if run.kills_at_startup + run.kills_training == kills:
                break
            at_startup = rng.random() < 0.4
            victim = rng.choice(job.agents)
            pid = _next_worker(job, victim, killed, started)
            if pid is None:
                run.notes.append("the job ended before every kill")
                break
            if at_startup:
                time.sleep(rng.uniform(0.0, 3.0))  # imports, group, build, resume
            else:
                _wait_row_after(job, last_kill, started)
                time.sleep(rng.uniform(0.0, 0.4))
            if _kill(pid):
                killed.add(pid)
                last_kill = time.time()
                kill_times.append((last_kill, victim.name))
                if at_startup:
                    run.kills_at_startup += 1
                else:
                    run.kills_training += 1
        codes = job.wait_agents(max(1.0, JOB_TIMEOUT_S - (time.monotonic() - started)))
        run.wall_s = round(time.monotonic() - started, 1)
        rows = job.metrics()
        run.restarts = max((r["restart_count"] for r in rows), default=0)
        waits = survivor_waits(job, kill_times)
        run.max_survivor_wait_s = round(max(waits), 2) if waits else None
        run.outcome = _check(job, codes, rows, ref)
    except Exception as exc:  # a hang or a harness error is this run's outcome
        run.wall_s = round(time.monotonic() - started, 1)
        run.outcome = f"error: {type(exc).__name__}: {str(exc)[:300]}"
    finally:
        job.close()
        if memory_root:
            shutil.rmtree(memory_root, ignore_errors=True)
    return run


def survivor_waits(job: ElasticJob, kills: list[tuple[float, str]]) -> list[float]:
    """Per kill (time, victim agent): seconds until the other agent stopped its worker
    ("closing signal SIGTERM") or saw it fail ("failed (exitcode"), whichever came first
    (infinity when it did neither)."""
    from bench.elastic_runs import torch_marks

    year = time.localtime().tm_year
    released = {
        a.name: sorted(
            torch_marks([a.log()], year, "closing signal SIGTERM")
            + torch_marks([a.log()], year, "failed (exitcode")
        )
        for a in job.agents
    }
    out = []
    for when, victim in kills:
        other = next(a.name for a in job.agents if a.name != victim)
        after = [t for t in released[other] if t >= when - 0.5]
        out.append(after[0] - when if after else math.inf)
    return out


def _next_worker(job: ElasticJob, agent, killed: set[int], started: float) -> int | None:
    """A live worker of ``agent`` that was not killed yet (a new attempt's), or None when
    the agent has exited."""
    while time.monotonic() - started < JOB_TIMEOUT_S:
        if agent.proc.poll() is not None:
            return None
        workers = [p for p in job.worker_pids(agent) if p not in killed]
        if workers:
            return workers[-1]  # the deepest: the trainer itself under -m warmstart's launcher
        time.sleep(0.05)
    return None


def _wait_row_after(job: ElasticJob, t: float, started: float) -> None:
    while time.monotonic() - started < JOB_TIMEOUT_S:
        rows = job.metrics()
        if rows and rows[-1]["time"] > t:
            return
        if all(a.proc.poll() is not None for a in job.agents):
            return
        time.sleep(0.1)


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def _check(job, codes, rows, ref) -> str:
    losses, params = ref
    if any(codes.values()):
        return f"failed: agents {codes}"
    if not rows or rows[-1]["step"] != STEPS:
        return f"failed: last step {rows[-1]['step'] if rows else None}"
    wrong = [r["step"] for r in rows if r["loss"] != losses[r["step"]]]
    if wrong:
        return f"failed: losses differ at steps {wrong[:10]}"
    final = torch.load(os.path.join(job.run_dir, "final_params.pt"), weights_only=True)
    if set(final) != set(params) or any(not torch.equal(final[k], params[k]) for k in params):
        return "failed: final parameters differ"
    return "ok: bitwise equal to the uninterrupted run"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testing.soak", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--backend", choices=BACKENDS, default="ft")
    parser.add_argument("--seeds", default="1", help="comma-separated seeds, one run each")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--warm", action="store_true", help="launch through -m warmstart")
    parser.add_argument("--memory", action="store_true", help="memory tier on")
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="soak-")
    runs = []
    try:
        ref = reference(work, args.backend)
        for seed in (int(s) for s in args.seeds.split(",") if s.strip()):
            run = soak_once(
                work, SoakRun(seed, args.backend, args.warm, args.memory), args.kills, ref
            )
            runs.append(run)
            print(json.dumps(asdict(run)), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in runs], fh, indent=1)
    return 0 if all(r.outcome.startswith("ok") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
