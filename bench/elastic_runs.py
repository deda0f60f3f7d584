"""``restart_overhead``, ``ettr`` and ``silent_node_loss``: real torchrun jobs.

``silent_node_loss`` (3 agents, one frozen by SIGSTOP): see :func:`silent_node_run`
and :func:`silent_loss`. The others: 2 agents with injected kills.

Each job is :class:`testing.local_cluster.ElasticJob` (a standalone c10d store and
two ``torchrun`` agents, one worker each) running the tiny GPT with async
checkpoints; ``TRAINER_FAULTS`` SIGKILLs one worker in each of several attempts.
From ``metrics.jsonl`` and ``events.jsonl``:

- per restart: last row before the kill -> first row after the resume, minus the
  checkpoint load duration (``checkpoint_loaded``.duration_s); split into
  detection + rendezvous + spawn/import/process group + model build (the gap from
  the ``fault`` event to the next ``start`` event, minus the load), the load, and
  the first step (its ``step_time_s``);
- goodput over the whole run with :func:`trainer.report.summarize`.

The baseline is one cold ``python -c "import torch; ...; init_process_group('gloo')"``
(1 process, file:// init), timed as the subprocess's wall time.
"""

from __future__ import annotations

import datetime
import itertools
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.gpt import CONFIG, REPO

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
    """One kill per attempt, alternating ranks: ``kill:step=S:rank=R:attempt=A;...``."""
    return ";".join(
        f"kill:step={s}:rank={(a + 1) % 2}:attempt={a}" for a, s in enumerate(kill_steps)
    )


def elastic_run(
    work: str, max_steps: int, kill_steps: list[int], ckpt_every: int, timeout_s: float
) -> dict[str, Any]:
    """One 2-agent job with a kill at each of ``kill_steps``; returns its rows and events."""
    from testing.local_cluster import ElasticJob

    args = [
        "--config", CONFIG, "--max-steps", str(max_steps), "--ckpt-every", str(ckpt_every),
        "--set", "checkpoint.async_save=true", "--set", f"run.log_every={max_steps}",
    ]  # fmt: skip
    job = ElasticJob(
        os.path.join(work, f"job_{time.monotonic_ns()}"),
        trainer_args=args,
        max_restarts=len(kill_steps),
        env={"TRAINER_FAULTS": fault_spec(kill_steps), "PYTHONPATH": REPO},
    )
    t0 = time.monotonic()
    try:
        job.add_agent()
        job.add_agent()
        codes = job.wait_agents(timeout_s)
        wall = time.monotonic() - t0
        if any(codes.values()):
            raise RuntimeError(f"elastic job failed: {codes}\n{job.logs_tail()}")
        logs = [agent.log() for agent in job.agents]
        return {"metrics": job.metrics(), "events": job.events(), "job_wall_s": wall, "logs": logs}
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


def restarts(
    metrics: list[dict], events: list[dict], logs: list[str] | None = None
) -> list[dict[str, float]]:
    """One breakdown per attempt boundary (restart_count going up)."""
    out = []
    year = datetime.datetime.fromtimestamp(float(metrics[0]["time"])).year if metrics else 1970
    marks = log_marks(logs or [], year)
    faults = [e for e in events if e.get("event") == "fault"]
    starts = [e for e in events if e.get("event") == "start"]
    loads = [e for e in events if e.get("event") == "checkpoint_loaded"]
    for prev, row in itertools.pairwise(metrics):
        if row["restart_count"] <= prev["restart_count"]:
            continue
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
    work: str, max_steps: int, freeze_after_step: int, ckpt_every: int, timeout_s: float
) -> dict[str, Any]:
    """One 3-agent job (default trainer settings, the peer failure detector included) whose
    non-rank-0 node is frozen (SIGSTOP of its agent and worker) after ``freeze_after_step``.

    Returns rows, events of every rank, agent logs (torchrun at ``LOGLEVEL=INFO``, for the
    rendezvous mark) and the freeze time (unix).
    """
    from testing.local_cluster import ElasticJob

    args = [
        "--config", CONFIG, "--max-steps", str(max_steps), "--ckpt-every", str(ckpt_every),
        "--set", f"run.log_every={max_steps}",
    ]  # fmt: skip
    job = ElasticJob(
        os.path.join(work, f"silent_{time.monotonic_ns()}"),
        trainer_args=args,
        env={"PYTHONPATH": REPO, "LOGLEVEL": "INFO"},
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


def _torch_marks(logs: list[str], year: int, needle: str) -> list[float]:
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
    verdicts = [float(e["time"]) for e in events if e["event"] == "peer_silent"]
    detected = min(t for t in verdicts if t > frozen_at)
    year = datetime.datetime.fromtimestamp(frozen_at).year
    rdzv = next(t for t in _torch_marks(logs, year, _RDZV_DONE) if t > detected)
    built = next(t for t, kind in log_marks(logs, year) if kind == "built" and t > rdzv)
    load = next(
        (
            e
            for e in events
            if e["event"] == "checkpoint_loaded" and built <= float(e["time"]) <= shrunk["time"]
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
