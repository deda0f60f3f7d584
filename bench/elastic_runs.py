"""``restart_overhead``, ``ettr`` and ``silent_node_loss``: real torchrun jobs.

``silent_node_loss`` (3 agents, one frozen by SIGSTOP): see :func:`silent_node_run`
and :func:`silent_loss`. The others: 2 agents with injected kills (the jobs of
:mod:`bench.fault_cost`, which also yields ``fault_cost_s``).

Each job is :class:`testing.local_cluster.ElasticJob` (a standalone c10d store and
two ``torchrun`` agents, one worker each) running the tiny GPT with async
checkpoints (and, with ``memory_every``, the memory tier, each agent a node of its
own); ``TRAINER_FAULTS`` SIGKILLs one worker in each of several attempts. With
``warm=True`` the agents run the warm restart launcher, ``-m warmstart -m trainer
...``, instead of ``-m trainer ...``. From ``metrics.jsonl``, the events of every
rank and the agents' logs:

- per restart (:func:`restarts`): last row before the kill -> first row after the
  resume, minus the checkpoint load duration (``checkpoint_loaded``.duration_s);
  split into detection, rendezvous + spawn/import/process group, model build (agent
  log timestamps), the load, and the first step (its ``step_time_s``);
- goodput over the whole run with :func:`trainer.report.summarize`.

The baseline is one cold ``python -c "import torch; ...; init_process_group('gloo')"``
(1 process, file:// init), timed as the subprocess's wall time.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

from bench.gpt import CONFIG, REPO
from runcore import events as ev

COLD_INIT = (
    "import sys, torch, torch.distributed as dist; "
    "dist.init_process_group('gloo', init_method='file://' + sys.argv[1], rank=0, world_size=1); "
    "dist.barrier(); dist.destroy_process_group()"
)


def cold_init_s(work: str) -> float:
    """Wall time of a fresh interpreter that imports torch and builds a 1-rank gloo group."""
    init_file = os.path.join(work, f"init_{time.monotonic_ns()}")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", COLD_INIT, init_file], check=True, capture_output=True)
    elapsed = time.perf_counter() - t0
    if os.path.exists(init_file):
        os.unlink(init_file)
    return elapsed


def fault_spec(kill_steps: list[int]) -> str:
    """One kill per attempt, for the one worker of the agent that gets it:
    ``kill:step=S:attempt=A;...`` (no rank: whichever rank that worker holds).

    Always the same agent's worker: the job-wide restart count is the highest of the
    agents' (``elastic.identity.job_restart_count``), and an agent whose worker merely
    lost its peer restarts at most once per kill, so the victim's agent holds the highest
    count and each attempt's kill fires exactly once. (Kills that alternate between
    agents can fire twice: the other agent's count may lag one behind.)
    """
    return ";".join(f"kill:step={s}:attempt={a}" for a, s in enumerate(kill_steps))


WARM_MODULE = "warmstart"
"""The warm restart launcher: ``torchrun ... -m warmstart -m trainer <args>``."""


def warm_available() -> bool:
    """True when the warm restart launcher (module :data:`WARM_MODULE`) can be imported."""
    return importlib.util.find_spec(WARM_MODULE) is not None


def worker_pythonpath() -> str:
    """The repository, then this process's ``PYTHONPATH``: workers import what
    :func:`warm_available` found here."""
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != REPO]
    return os.pathsep.join([REPO, *extra])


def launch_module(trainer_args: list[str], warm: bool) -> tuple[str, list[str]]:
    """``(module, args)`` for :class:`testing.local_cluster.ElasticJob`: the trainer itself,
    or the warm launcher with ``-m trainer <args>`` (ElasticJob runs ``-m module args``)."""
    if warm:
        return WARM_MODULE, ["-m", "trainer", *trainer_args]
    return "trainer", list(trainer_args)


def elastic_run(
    work: str,
    max_steps: int,
    kill_steps: list[int],
    ckpt_every: int,
    timeout_s: float,
    *,
    warm: bool = False,
    memory_every: int = 0,
    rdzv_backend: str = "c10d",
    trainer_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One 2-agent job whose agent 0's worker is killed before each of ``kill_steps``
    (:func:`fault_spec`); returns its rows, the events of every rank and the agent logs.
    ``trainer_args`` go to the trainer after the job's own (``--set model.d_model=256``).

    Durable checkpoints (async) every ``ckpt_every`` steps; with ``memory_every`` > 0 the
    memory tier is on too (``checkpoint.memory_every``), each agent a node of its own
    (its own ``CKPT_MEMORY_DIR`` under /dev/shm, removed afterwards). ``warm``: launch
    through :data:`WARM_MODULE` instead of the trainer itself. ``rdzv_backend``: torchrun's
    ``c10d`` or ours, ``ft`` (:mod:`elastic.rendezvous`).
    """
    from bench.harness.local_cluster import ElasticJob

    args = [
        "--config", CONFIG, "--max-steps", str(max_steps), "--ckpt-every", str(ckpt_every),
        "--set", "checkpoint.async_save=true", "--set", f"run.log_every={max_steps}",
    ]  # fmt: skip
    if memory_every:
        args += ["--set", f"checkpoint.memory_every={memory_every}"]
    module, launch_args = launch_module([*args, *trainer_args], warm)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else work
    memory = os.path.join(shm, f"bench-elastic-{uuid.uuid4().hex[:8]}")
    job = ElasticJob(
        os.path.join(work, f"job_{time.monotonic_ns()}"),
        trainer_args=launch_args,
        module=module,
        max_restarts=len(kill_steps),
        env={"PYTHONPATH": worker_pythonpath()},
        rdzv_backend=rdzv_backend,
    )
    t0 = time.monotonic()
    try:
        for i in range(2):
            faults = fault_spec(kill_steps) if i == 0 else ""  # agent 0's worker is killed
            node = os.path.join(memory, f"node{i}")
            job.add_agent(env={"CKPT_MEMORY_DIR": node, "TRAINER_FAULTS": faults})
        codes = job.wait_agents(timeout_s)
        wall = time.monotonic() - t0
        if any(codes.values()):
            raise RuntimeError(f"elastic job failed: {codes}\n{job.logs_tail()}")
        logs = [agent.log() for agent in job.agents]
        return {
            "metrics": job.metrics(),
            "events": job.all_events(),
            "job_wall_s": wall,
            "logs": logs,
            "launcher": "warmstart" if warm else "plain",
            "rdzv_backend": rdzv_backend,
        }
    finally:
        job.close()
        shutil.rmtree(memory, ignore_errors=True)


LOADER_EXAMPLE = "examples.bring_your_own_model"
"""The job of the loader-worker variant: the project's own user script, run as a module
(``python -m examples.bring_your_own_model``; a source checkout)."""


def loader_run(
    work: str,
    max_steps: int,
    kill_steps: list[int],
    ckpt_every: int,
    timeout_s: float,
    *,
    num_workers: int = 2,
    warm: bool = False,
    rdzv_backend: str = "ft",
) -> dict[str, Any]:
    """One agent with two workers running ``examples/bring_your_own_model.py`` with
    ``--num-workers`` ``DataLoader`` worker processes; rank 1 is SIGKILLed before each of
    ``kill_steps`` (one per attempt), so torchrun sends the surviving rank 0 SIGTERM and
    restarts both. Async durable checkpoints every ``ckpt_every`` steps. Returns the rows,
    the events of every rank and the agent's log (torchrun's marks of the SIGTERM and of
    the group's exit, :func:`bench.fault_cost.survivor_exits`)."""
    from bench.harness.local_cluster import ElasticJob

    args = [
        "--max-steps", str(max_steps), "--ckpt-every", str(ckpt_every), "--async-save",
        "--num-workers", str(num_workers),
    ]  # fmt: skip
    module, program_args = (WARM_MODULE, ["-m", LOADER_EXAMPLE, *args]) if warm else (
        LOADER_EXAMPLE, args)  # fmt: skip
    faults = ";".join(f"kill:step={s}:rank=1:attempt={a}" for a, s in enumerate(kill_steps))
    job = ElasticJob(
        os.path.join(work, f"loader_{time.monotonic_ns()}"),
        trainer_args=program_args,
        module=module,
        nnodes="1",
        nproc_per_node=2,
        max_restarts=len(kill_steps),
        env={"PYTHONPATH": worker_pythonpath(), "TRAINER_FAULTS": faults},
        rdzv_backend=rdzv_backend,
    )
    t0 = time.monotonic()
    try:
        job.add_agent()
        codes = job.wait_agents(timeout_s)
        wall = time.monotonic() - t0
        if any(codes.values()):
            raise RuntimeError(f"loader-worker job failed: {codes}\n{job.logs_tail()}")
        return {
            "metrics": job.metrics(),
            "events": job.all_events(),
            "job_wall_s": wall,
            "logs": [agent.log() for agent in job.agents],
            "launcher": "warmstart" if warm else "plain",
            "rdzv_backend": rdzv_backend,
            "num_workers": num_workers,
        }
    finally:
        job.close()


_TRAINER_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (.*)$")
_TORCH_TS = re.compile(r"^[EWI](\d{4}) (\d\d:\d\d:\d\d\.\d{6}) \d+ (.*)$")


def log_marks(logs: list[str], year: int) -> list[tuple[float, str]]:
    """``(unix time, kind)`` of the log lines that time a restart, from every agent's log.

    Kinds: ``failed`` (torchrun saw a worker exit), ``pg_ready`` (rank 0's process
    group is up), ``built`` (rank 0 built data, model, optimizer; the load starts).
    Timestamps are local time, as ``time.time()`` in the rows is compared with them.
    """
    marks: list[tuple[float, str]] = []
    for text in logs:
        for line in text.splitlines():
            m = _TRAINER_TS.match(line)
            if m:
                ts = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                if "[rank 0]" in m.group(2) and "process group ready" in m.group(2):
                    marks.append((ts, "pg_ready"))
                elif "[rank 0]" in m.group(2) and "looking for a committed checkpoint" in m.group(
                    2
                ):
                    marks.append((ts, "built"))
                continue
            m = _TORCH_TS.match(line)
            if m and "failed (exitcode" in m.group(3):
                stamp = f"{year}{m.group(1)} {m.group(2)}"
                ts = datetime.datetime.strptime(stamp, "%Y%m%d %H:%M:%S.%f").timestamp()
                marks.append((ts, "failed"))
    return sorted(marks)


def attempt_starts(metrics: list[dict]) -> list[int]:
    """Indices of the rows that begin a new attempt: ``restart_count`` or ``world_size``
    changed, or the step did not go up (a resume re-ran steps). The rule of
    :func:`trainer.report.split_attempts`, so boundaries here are that report's."""
    out = []
    for i in range(1, len(metrics)):
        prev, row = metrics[i - 1], metrics[i]
        if (
            row.get("restart_count", 0) != prev.get("restart_count", 0)
            or row.get("world_size", 1) != prev.get("world_size", 1)
            or int(row["step"]) <= int(prev["step"])
        ):
            out.append(i)
    return out


def restarts(
    metrics: list[dict], events: list[dict], logs: list[str] | None = None
) -> list[dict[str, float]]:
    """One breakdown per attempt boundary (:func:`attempt_starts`)."""
    out = []
    year = datetime.datetime.fromtimestamp(float(metrics[0]["time"])).year if metrics else 1970
    marks = log_marks(logs or [], year)
    faults = [e for e in events if e.get("event") == ev.FAULT]
    starts = [e for e in events if e.get("event") == ev.START]
    loads = [e for e in events if e.get("event") == ev.CHECKPOINT_LOADED]
    for i in attempt_starts(metrics):
        prev, row = metrics[i - 1], metrics[i]
        attempt = row["restart_count"]
        load = next(
            (e for e in loads if e["time"] > prev["time"] and e["time"] < row["time"]), None
        )
        start = next(
            (e for e in starts if e["time"] > prev["time"] and e["time"] < row["time"]), None
        )
        fault = next(
            (e for e in faults if e["time"] >= prev["time"] - 1e-3 and e["time"] < row["time"]),
            None,
        )
        load_s = float(load["duration_s"]) if load else 0.0
        total = float(row["time"]) - float(prev["time"])
        item = {
            "attempt": attempt,
            "restart_to_first_step_s": total,
            "load_s": load_s,
            "overhead_s": total - load_s,
            "first_step_s": float(row["step_time_s"]),
            "rerun_from_step": int(row["step"]),
            "killed_after_step": int(prev["step"]),
        }
        if start is not None:
            # kill (at the next step's start, just after prev's row) -> the new attempt's
            # "start" event, which follows the load: detection, rendezvous, spawn,
            # import, process group, model build, then the load.
            item["kill_to_start_event_s"] = float(start["time"]) - float(
                fault["time"] if fault else prev["time"]
            )
            item["up_to_load_s"] = item["kill_to_start_event_s"] - load_s
            item["start_event_to_first_row_s"] = float(row["time"]) - float(start["time"])
        in_gap = [(t, k) for t, k in marks if float(prev["time"]) <= t <= float(row["time"])]
        failed = next((t for t, k in in_gap if k == "failed"), None)
        pg = next((t for t, k in in_gap if k == "pg_ready"), None)
        built = next((t for t, k in in_gap if k == "built"), None)
        if failed is not None and pg is not None and built is not None:
            # kill -> torchrun notices a worker exited (the killed one, or the survivor
            # whose gloo peer vanished) -> restart round: rendezvous, spawn, import
            # torch + trainer, init_process_group -> data + model + optimizer build.
            item["detect_s"] = failed - float(prev["time"])
            item["rdzv_spawn_import_pg_s"] = pg - failed
            item["build_s"] = built - pg
        out.append(item)
    return out


def goodput(metrics: list[dict], events: list[dict]) -> dict[str, Any]:
    from trainer.report import summarize

    s = summarize(metrics, events)
    return {
        "goodput": s.goodput,
        "wall_time_s": s.wall_time_s,
        "productive_time_s": s.productive_time_s,
        "downtime_s": s.downtime_s,
        "rerun_time_s": s.rerun_time_s,
        "restarts": s.max_restart_count,
        "checkpoints_committed": s.checkpoints_committed,
        "checkpoint_mean_duration_s": s.checkpoint_mean_duration_s,
    }


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- silent_node_loss: a node frozen (SIGSTOP), not killed -----------------------------------

SILENT_AGENTS = 3
"""Agents of the silent-node job: one is frozen, the job goes on at world size 2."""

_RDZV_DONE = "Rendezvous complete for workers"


def silent_node_run(
    work: str,
    max_steps: int,
    freeze_after_step: int,
    ckpt_every: int,
    timeout_s: float,
    *,
    rdzv_backend: str = "c10d",
    warm: bool = False,
) -> dict[str, Any]:
    """One 3-agent job (default trainer settings, the peer failure detector included) whose
    non-rank-0 node is frozen (SIGSTOP of its agent and worker) after ``freeze_after_step``;
    ``warm``: workers through :data:`WARM_MODULE`.

    Returns rows, events of every rank, agent logs (torchrun at ``LOGLEVEL=INFO``, for the
    rendezvous mark) and the freeze time (unix).
    """
    from bench.harness.local_cluster import ElasticJob

    args = [
        "--config", CONFIG, "--max-steps", str(max_steps), "--ckpt-every", str(ckpt_every),
        "--set", f"run.log_every={max_steps}",
    ]  # fmt: skip
    module, trainer_args = launch_module(args, warm)
    job = ElasticJob(
        os.path.join(work, f"silent_{time.monotonic_ns()}"),
        trainer_args=trainer_args,
        module=module,
        env={"PYTHONPATH": worker_pythonpath(), "LOGLEVEL": "INFO"},
        rdzv_backend=rdzv_backend,
    )
    try:
        agents = [job.add_agent() for _ in range(SILENT_AGENTS)]
        job.wait_for(
            lambda: (
                job.last_step() >= freeze_after_step
                and job.metrics()[-1]["world_size"] == SILENT_AGENTS
            ),
            timeout_s,
            f"step {freeze_after_step} at world size {SILENT_AGENTS}",
        )
        rank0 = job.agent_of_rank0(SILENT_AGENTS)
        victim = next(a for a in agents if a is not rank0)
        frozen_at = time.time()
        job.freeze_node(victim)
        survivors = [a for a in agents if a is not victim]
        codes = job.wait_agents(timeout_s, survivors)
        if any(codes.values()):
            raise RuntimeError(f"silent-node job failed: {codes}\n{job.logs_tail()}")
        return {
            "metrics": job.metrics(),
            "events": job.all_events(),
            "logs": [a.log() for a in survivors],
            "frozen_at": frozen_at,
        }
    finally:
        job.close()


def torch_marks(logs: list[str], year: int, needle: str) -> list[float]:
    """Unix times of torchrun's log lines (``[IWE]MMDD HH:MM:SS.ffffff pid ...``) that
    contain ``needle``, from every log, sorted (local time, of the year ``year``)."""
    out = []
    for text in logs:
        for line in text.splitlines():
            m = _TORCH_TS.match(line)
            if m and needle in m.group(3):
                stamp = f"{year}{m.group(1)} {m.group(2)}"
                out.append(datetime.datetime.strptime(stamp, "%Y%m%d %H:%M:%S.%f").timestamp())
    return sorted(out)


def silent_loss(
    metrics: list[dict], events: list[dict], logs: list[str], frozen_at: float
) -> dict[str, float]:
    """Freeze -> first step at the smaller world size, and where the time went (pure).

    ``detect_s``: freeze -> the first ``peer_silent`` verdict; ``rendezvous_s``: -> a
    survivor's agent completes the new rendezvous (worker exit noticed, the frozen node
    left out); ``restart_s``: -> rank 0 of the new group has its process group and model
    (spawn, import, ``init_process_group``, build); ``load_s``: the checkpoint load;
    ``first_step_s``: the rest, up to the first metrics row (mostly the step itself).
    """
    shrunk = min(
        (r for r in metrics if float(r["time"]) > frozen_at and r["world_size"] < SILENT_AGENTS),
        key=lambda r: float(r["time"]),
    )
    total = float(shrunk["time"]) - frozen_at
    verdicts = [float(e["time"]) for e in events if e["event"] == ev.PEER_SILENT]
    detected = min(t for t in verdicts if t > frozen_at)
    year = datetime.datetime.fromtimestamp(frozen_at).year
    rdzv = next(t for t in torch_marks(logs, year, _RDZV_DONE) if t > detected)
    built = next(t for t, kind in log_marks(logs, year) if kind == "built" and t > rdzv)
    load = next(
        (
            e
            for e in events
            if e["event"] == ev.CHECKPOINT_LOADED and built <= float(e["time"]) <= shrunk["time"]
        ),
        None,
    )
    load_s = float(load["duration_s"]) if load else 0.0
    return {
        "silent_node_loss_s": total,
        "detect_s": detected - frozen_at,
        "rendezvous_s": rdzv - detected,
        "restart_s": built - rdzv,
        "load_s": load_s,
        "first_step_s": float(shrunk["time"]) - built - load_s,
        "first_step_time_s": float(shrunk["step_time_s"]),
        "resumed_step": int(shrunk["step"]) - 1,
        "world_size_after": int(shrunk["world_size"]),
    }
