"""``fault_cost_s`` and ``ettr``: what a worker kill costs, with and without the memory tier.

One 2-agent torchrun job (:func:`bench.elastic_runs.elastic_run`) of the tiny GPT with
the memory tier on (a snapshot every ``memory_every`` steps, each agent a node of its
own) and async durable checkpoints every ``durable_every`` steps, a worker SIGKILLed at
each of ``kill_steps`` (one per attempt, always agent 0's worker, whichever rank it holds:
see :func:`bench.elastic_runs.fault_spec`); the baseline is the same
job with the durable tier only. From each job's ``metrics.jsonl``, events and agent
logs (:func:`fault_cost`, pure):

- per kill: ``downtime_s`` (the last row before the kill -> the start of the first step
  after the resume, as :func:`trainer.report.summarize` counts it) + ``rerun_s`` (the
  step times of the rows the kill threw away: steps run again after the resume) =
  ``lost_s``; the downtime split into ``detect_s`` (-> torchrun's "failed (exitcode"),
  ``rdzv_spawn_import_pg_s`` (-> rank 0's process group is up), ``build_s`` (-> rank 0
  looks for a checkpoint), ``load_s`` (the manager's ``resume`` event: tier choice,
  assembly or read, load) and ``other_s`` (the rest: bookkeeping up to the first step);
- ``fault_cost_s`` = (``downtime_s`` + ``rerun_time_s``) / kills, the totals of
  :func:`trainer.report.summarize`; ``goodput`` from the same summary is ``ettr``;
- per kill also ``first_step_s`` (the first step after the resume) and
  ``first_step_excess_s`` (it minus the job's median step time, at least 0): cold costs
  of a new process that a resume does not pay are paid there (the first ``optimizer.step()``
  computes DTensor's sharding propagation of every op of the step), and the downtime ends
  where that step starts. ``fault_cost_with_first_step_s`` adds them: (``downtime_s`` +
  ``rerun_time_s`` + the excesses) / kills.

The kills are spaced for a fault about every ``FAULT_EVERY_S`` seconds as the bench
counts it (``mean_s_between_faults``: the job's wall time / (kills + 1)): the plan is
sized in steps from the step time of the shorter jobs run just before
(:meth:`KillPlan.sized`), since the step time differs between machines and, on a shared
one, between runs: a plan fixed in steps would space the faults as much further apart as
the steps are slower. The default plan (:class:`KillPlan` as it stands) is the
one for 0.22 s steps.
"""

from __future__ import annotations

import datetime
import math
import statistics
from dataclasses import dataclass
from typing import Any

from bench.elastic_runs import attempt_starts, elastic_run, loader_run, log_marks, torch_marks
from runcore import events as ev

FAULT_EVERY_S = 30.0
"""Target spacing of the kills, in seconds of training with the memory tier on."""

DURABLE_EVERY = 20
"""Durable checkpoint interval of the kill jobs (the kills' re-runs are set against it)."""
PERIOD_OVERHEAD_S = 2.0
"""Seconds of each period between faults that are not steps (:meth:`KillPlan.sized`):
a job's wall time less its steps' time, over its periods; under 2 s for the tiny GPT."""

PHASES = ("detect_s", "rdzv_spawn_import_pg_s", "build_s", "load_s", "other_s", "rerun_s")
"""Where the time of one kill goes (``lost_s`` is their sum when the log marks were found)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KillPlan:
    """The jobs of ``fault_cost_s``: the same steps, checkpoints and kills for both tiers."""

    max_steps: int = 492
    kill_steps: tuple[int, ...] = (129, 251, 373)
    """A kill fires before the step: the last rows are 128, 250 and 372, so the durable-only
    baseline (checkpoints at 120, 240, 360) re-runs 8, 10 and 12 steps (mean N/2) and the
    memory tier (snapshots every 5 steps) 3, 0 and 2."""
    durable_every: int = DURABLE_EVERY
    memory_every: int = 5
    """The K of ``memory_tier_stall``'s headline. With K = 1 the snapshots cost more per
    step than the re-run steps they save: goodput and ``fault_cost_s`` are both worse than
    durable-only (see BENCHMARKS.md)."""

    @classmethod
    def sized(cls, step_s: float, every_s: float = FAULT_EVERY_S) -> KillPlan:
        """The plan with a fault about every ``every_s`` seconds (as the bench counts
        them) at ``step_s`` seconds per step: ``n`` steps apart, ``n`` a multiple of the
        durable interval (20), so the re-runs stay 8/10/12 and 3/0/2 steps as in the
        default plan. ``PERIOD_OVERHEAD_S`` of each period is not steps (the downtime, the
        first step, the job's start spread over the periods)."""
        interval = DURABLE_EVERY
        if not step_s > 0:
            raise ValueError(f"a kill plan needs a step time > 0, got {step_s!r}")
        n = max(2, round((every_s - PERIOD_OVERHEAD_S) / step_s / interval)) * interval
        last_rows = (n + 8, 2 * n + 10, 3 * n + 12)
        return cls(max_steps=4 * n + 12, kill_steps=tuple(r + 1 for r in last_rows))

    def settings(self) -> dict[str, Any]:
        return {
            "max_steps": self.max_steps,
            "kill_steps": list(self.kill_steps),
            "durable_every_steps": self.durable_every,
            "memory_every_steps": self.memory_every,
            "checkpoint": "async durable saves",
            "agents": 2,
            "kills": "SIGKILL of agent 0's worker (any rank) once per attempt (TRAINER_FAULTS)",
        }


def fault_cost_run(
    work: str,
    plan: KillPlan,
    timeout_s: float,
    *,
    memory: bool,
    warm: bool,
    rdzv_backend: str = "c10d",
    trainer_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One job of ``plan`` (memory tier on or off); :func:`elastic_run`'s result plus
    ``cost`` (:func:`fault_cost`) and ``tiers``. ``trainer_args``: see :func:`elastic_run`."""
    out = elastic_run(
        work,
        plan.max_steps,
        list(plan.kill_steps),
        plan.durable_every,
        timeout_s,
        warm=warm,
        memory_every=plan.memory_every if memory else 0,
        rdzv_backend=rdzv_backend,
        trainer_args=trainer_args,
    )
    out["cost"] = fault_cost(out["metrics"], out["events"], out["logs"], kills=len(plan.kill_steps))
    out["tiers"] = "memory + durable" if memory else "durable only"
    return out


LOADER_PLAN = KillPlan(max_steps=252, kill_steps=(69, 131, 193), memory_every=0)
"""The loader-worker job (:func:`loader_fault_cost_run`): durable checkpoints every 20 steps,
rank 1 killed after rows 68, 130 and 192 (re-runs of 8, 10 and 12 steps)."""
SIGTERM_MARK = "closing signal SIGTERM"
GROUP_EXIT_MARK = "failed (exitcode"


def survivor_exits(logs: list[str], year: int) -> list[float]:
    """Seconds from each SIGTERM torchrun sent to the survivors of a failed worker group
    ("Sending process N closing signal SIGTERM") to its report of the group's failure
    ("failed (exitcode ..."), which it writes once every worker has exited (pure).

    After a kill torchrun signals the group's live workers and waits for all of them, so
    this is how long the slowest survivor took to leave after the signal; a survivor that
    left on its own first (its collective with the dead rank failed) gets no signal and
    adds nothing."""
    marks = sorted(
        [(t, "sigterm") for t in torch_marks(logs, year, SIGTERM_MARK)]
        + [(t, "exit") for t in torch_marks(logs, year, GROUP_EXIT_MARK)]
    )
    out: list[float] = []
    signalled: float | None = None
    for t, kind in marks:
        if kind == "sigterm":
            signalled = t if signalled is None else signalled
        elif signalled is not None:
            out.append(t - signalled)
            signalled = None
    return out


def loader_fault_cost_run(
    work: str, plan: KillPlan, timeout_s: float, *, warm: bool, rdzv_backend: str = "ft"
) -> dict[str, Any]:
    """The loader-worker job of ``plan`` (:func:`bench.elastic_runs.loader_run`):
    its result plus ``cost`` (:func:`fault_cost`) and ``survivor_exit_s``
    (:func:`survivor_exits`)."""
    steps = (plan.max_steps, list(plan.kill_steps), plan.durable_every)
    out = loader_run(work, *steps, timeout_s, warm=warm, rdzv_backend=rdzv_backend)
    out["cost"] = fault_cost(out["metrics"], out["events"], out["logs"], kills=len(plan.kill_steps))
    year = datetime.datetime.fromtimestamp(float(out["metrics"][0]["time"])).year
    out["survivor_exit_s"] = survivor_exits(out["logs"], year)
    return out


def _in(events: list[dict], name: str, lo: float, hi: float) -> dict | None:
    return next((e for e in events if e.get("event") == name and lo < float(e["time"]) < hi), None)


def fault_cost(
    metrics: list[dict],
    events: list[dict],
    logs: list[str] | None = None,
    *,
    kills: int | None = None,
) -> dict[str, Any]:
    """Seconds lost per kill, the per-kill breakdown and the run's goodput (pure).

    ``kills``: how many were injected; a run with another number of attempt boundaries
    (an unplanned restart, a kill that did not fire) raises ValueError.
    """
    from trainer.report import rerun_mask, summarize

    summary = summarize(metrics, events)
    starts = attempt_starts(metrics)
    if kills is not None and len(starts) != kills:
        raise ValueError(f"{kills} kills injected but {len(starts)} restarts in the metrics")
    mask = rerun_mask(metrics)
    year = datetime.datetime.fromtimestamp(float(metrics[0]["time"])).year
    marks = log_marks(logs or [], year)
    per_kill: list[dict[str, Any]] = []
    step_median = statistics.median(float(r["step_time_s"]) for r in metrics)
    begin = 0
    for i in starts:
        prev, row = metrics[i - 1], metrics[i]
        last, first = float(prev["time"]), float(row["time"])
        rerun = [j for j in range(begin, i) if mask[j]]
        rerun_s = sum(float(metrics[j]["step_time_s"]) for j in rerun)
        first_step = float(row["step_time_s"])
        downtime = max(0.0, first - first_step - last)
        resume = _in(events, ev.RESUME, last, first)
        loaded = _in(events, ev.CHECKPOINT_LOADED, last, first)
        source = resume or loaded
        load_s = float(source["duration_s"]) if source and "duration_s" in source else 0.0
        item: dict[str, Any] = {
            "attempt": int(row.get("restart_count", 0)),
            "killed_after_step": int(prev["step"]),
            "resumed_from_step": int(row["step"]) - 1,
            "tier": (resume or {}).get("tier", "durable" if source else "none"),
            "downtime_s": downtime,
            "rerun_steps": len(rerun),
            "rerun_s": rerun_s,
            "lost_s": downtime + rerun_s,
            "load_s": load_s,
            "restart_s": downtime - load_s,
            "first_step_s": first_step,
            "first_step_excess_s": max(0.0, first_step - step_median),
        }
        gap = [(t, k) for t, k in marks if last <= t <= first]
        failed = next((t for t, k in gap if k == "failed"), None)
        pg = next((t for t, k in gap if k == "pg_ready"), None)
        built = next((t for t, k in gap if k == "built"), None)
        if failed is not None and pg is not None and built is not None:
            item["detect_s"] = failed - last
            item["rdzv_spawn_import_pg_s"] = pg - failed
            item["build_s"] = built - pg
            item["other_s"] = downtime - (built - last) - load_s
        per_kill.append(item)
        begin = i
    n = len(starts)
    excess = sum(k["first_step_excess_s"] for k in per_kill)
    lost = summary.downtime_s + summary.rerun_time_s
    return {
        "kills": n,
        "fault_cost_s": lost / n if n else math.nan,
        "fault_cost_with_first_step_s": (lost + excess) / n if n else math.nan,
        "first_step_excess_s": excess,
        "downtime_s": summary.downtime_s,
        "rerun_time_s": summary.rerun_time_s,
        "rerun_steps": summary.rerun_steps,
        "goodput": summary.goodput,
        "wall_time_s": summary.wall_time_s,
        "productive_time_s": summary.productive_time_s,
        "mean_s_between_faults": summary.wall_time_s / (n + 1),
        "step_time_median_s": step_median,
        "per_kill": per_kill,
    }


def phase_medians(per_kill: list[dict[str, Any]]) -> dict[str, float]:
    """Median of each of :data:`PHASES`, of ``lost_s`` and of the first step's time and
    excess over the kills that have it."""
    out = {}
    for key in (*PHASES, "lost_s", "first_step_s", "first_step_excess_s"):
        values = [float(k[key]) for k in per_kill if key in k]
        if values:
            out[key] = statistics.median(values)
    return out
