"""``python -m bench [--quick] [--only GROUP,...] [--json OUT] [--dir DIR] [--plot DIR]``:
measure, print a table of every metric (those not measured as NaN, with the reason), write
JSON. ``python -m bench curves ...`` is ``python -m bench --only curves ...``."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench import curves as cost_curves
from bench import memory_tier
from bench import metrics as m
from bench import rendezvous as rdzv
from bench import scale as plan_scale
from bench.async_rounds import async_rounds, staging_rounds
from bench.elastic_runs import (
    LOADER_EXAMPLE,
    WARM_MODULE,
    cold_init_s,
    elastic_run,
    goodput,
    restarts,
    silent_loss,
    silent_node_run,
    warm_available,
)
from bench.export import EXPORT_MIN_BYTES, export_metrics, export_rounds
from bench.fault_cost import LOADER_PLAN, KillPlan, fault_cost_run, loader_fault_cost_run
from bench.fsdp_state import layer_width
from bench.gcs import gcs_rounds
from bench.loader_rng import loader_metrics
from bench.report import markdown_table, write_json
from bench.rounds import load_rounds, reshard_load, reshard_save, save_rounds
from bench.s3 import s3_rounds
from bench.spawn import run_on_ranks
from bench.train_loop import plain_loop, steady_rate, trainer_run

RANKS = 2
RESHARD_FROM = 4
"""World size that writes the reshard_load checkpoint (and the same-world side loads into)."""
RESHARD_TO = 2
"""World size of the resharding side of reshard_load."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Mode:
    name: str
    total_bytes: int
    """Checkpoint size over all ranks (model + AdamW state, fp32)."""
    rounds: int
    """Steady-state repetitions per measurement (medians); saves add one warm-up."""
    timeout_s: float

    persist_bytes: int
    """State persisted in the background while the tiny GPT trains (persist_interference)."""
    gcs_bytes: int
    """Checkpoint size for the gs:// rounds (the emulator keeps objects in memory)."""
    s3_bytes: int
    """Checkpoint size for the s3:// rounds (SeaweedFS keeps them on local disk)."""
    replicated_bytes: int
    """State every rank of the replicated group holds (read_amplification)."""
    train_steps: int
    """Steps per trainer / plain-loop run (trainer_overhead); the first 5 are warm-up."""
    elastic_jobs: bool
    """Run the 2-agent torchrun jobs with kills (restart_overhead, fault_cost_s, ettr): one
    with the memory tier, one durable only, and a plain-launcher one when the warm
    launcher is used."""
    silent_runs: int
    """3-agent torchrun jobs with a frozen node (silent_node_loss); 0: not run."""
    spawn_rounds: int
    """Rounds of the measurements that spawn processes per sample (reshard loads,
    trainer vs plain-loop runs, exports): each costs a process start per side."""
    async_rounds: int
    """Rounds of async_stall and persist_interference (each saves the whole state three
    times, then persists it once more under training steps)."""
    staging_saves: int
    """Async saves in a row of async_staging_growth."""
    staging_bytes: int
    """Checkpoint size of async_staging_growth's state."""
    memory: memory_tier.Mode
    """The mode of :mod:`bench.memory_tier` (memory_tier_stall, peer_restore_vs_disk)."""
    rendezvous_n: tuple[int, ...]
    """Simulated agent counts of rendezvous_vs_c10d (:mod:`bench.rendezvous`)."""
    curves: cost_curves.CurvesMode
    scale: plan_scale.ScaleMode
    """The sizes, counts and rounds of the ``curves`` group (:mod:`bench.curves`)."""


QUICK = Mode(
    name="quick",
    total_bytes=64 << 20,
    rounds=3,
    timeout_s=150,
    persist_bytes=128 << 20,
    gcs_bytes=64 << 20,
    s3_bytes=32 << 20,
    replicated_bytes=64 << 20,
    train_steps=15,
    elastic_jobs=False,
    silent_runs=0,
    spawn_rounds=2,
    async_rounds=3,
    staging_saves=10,
    staging_bytes=32 << 20,
    memory=memory_tier.QUICK,
    rendezvous_n=rdzv.QUICK_N,
    curves=cost_curves.QUICK,
    scale=plan_scale.QUICK,
)
FULL = Mode(
    name="full",
    total_bytes=1 << 30,
    rounds=5,
    timeout_s=900,
    persist_bytes=1 << 30,
    gcs_bytes=256 << 20,
    s3_bytes=256 << 20,
    replicated_bytes=512 << 20,
    train_steps=45,
    elastic_jobs=True,
    silent_runs=2,
    spawn_rounds=3,
    async_rounds=3,
    staging_saves=100,
    staging_bytes=256 << 20,
    memory=memory_tier.FULL,
    rendezvous_n=rdzv.FULL_N,
    curves=cost_curves.FULL,
    scale=plan_scale.FULL,
)
WARMUP_STEPS = 5
FULL_ONLY = ("restart_overhead", "fault_cost_s", "ettr", "silent_node_loss",
             "loader_fault_cost_s", "loader_survivor_exit_s")  # fmt: skip
"""Metrics measured in full mode only (torchrun jobs of a minute or more each)."""
KILL_PLAN = KillPlan()
"""The jobs of restart_overhead, fault_cost_s and ettr (bench/fault_cost.py) when no
shorter job gave a step time to size them with (:meth:`KillPlan.sized`)."""
PLAIN_KILL_STEPS = [25, 50]
PLAIN_MAX_STEPS = 65
"""The shorter jobs beside the fault_cost_s ones (restart_overhead's detail only): the
trainer itself when the warm launcher is used, and the launcher on c10d."""
ELASTIC_CKPT_EVERY = 10
RDZV_SIM_TIMEOUT_S = 600.0
"""Bound of one rendezvous simulation (one backend, one N: starting its agents, its rounds)."""
RDZV_PHASE_TIMEOUT_S = 60.0
"""Bound of one round of a simulation below ``RDZV_LARGE_N`` agents (c10d's re-round after
a death at 8 agents takes over ten seconds on 2 cores)."""
RDZV_LARGE_N = 32
RDZV_LARGE_PHASE_TIMEOUT_S = 15.0
"""Bound of one round from ``RDZV_LARGE_N`` agents on. c10d's first round of 32 or more
agents on 2 cores rarely ends within a minute, at 128 or 256 agents not within two, so
a longer bound only waits longer; its lower bound of 15 s against ``ft``'s round of a few
seconds at 256 still decides the <= 1/3 target, at a quarter of the wait."""


def rdzv_phase_timeout_s(n: int) -> float:
    """The round bound of a simulation of ``n`` agents."""
    return RDZV_LARGE_PHASE_TIMEOUT_S if n >= RDZV_LARGE_N else RDZV_PHASE_TIMEOUT_S


OURS_RDZV = "ft"
"""The rendezvous backend of the elastic and silent-node jobs (elastic/rendezvous.py);
restart_overhead's detail has the same kill on torchrun's c10d beside it."""
SILENT_MAX_STEPS = 40
SILENT_FREEZE_AFTER = 12
"""silent_node_loss: 3 agents, checkpoints every ELASTIC_CKPT_EVERY steps, the node of a
non-zero rank frozen after this step; the job finishes at world size 2."""


def parse_only(text: str) -> tuple[str, ...]:
    """``--only`` value: comma-separated group names -> those groups, in run order."""
    names = [part.strip() for part in text.split(",")]
    bad = [n for n in names if n not in m.GROUPS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown group(s) {', '.join(repr(n) for n in bad)}; "
            f"valid groups: {', '.join(m.GROUPS)}"
        )
    return tuple(g for g in m.GROUPS if g in names)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    groups = "; ".join(f"{g}: {', '.join(names)}" for g, names in m.GROUPS.items())
    q, f = QUICK.memory, FULL.memory
    cq = QUICK.curves
    sq, sf = QUICK.scale, FULL.scale
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        epilog="restart_overhead, fault_cost_s and ettr run the trainer through the warm "
        f"restart launcher (torchrun ... -m {WARM_MODULE} -m trainer ...) when the module "
        f"{WARM_MODULE} can be imported, else the trainer itself (plus one job through the "
        "trainer itself for the cold figure when the warm launcher is used); "
        "detail.launcher says which. They and silent_node_loss run on this project's "
        f"rendezvous backend (torchrun --rdzv_backend={OURS_RDZV}); restart_overhead's "
        "detail.c10d is the same kill on torchrun's c10d. Progress goes to stderr: each "
        "task as it starts and its metrics as they land.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"64 MB state instead of 1 GB, {QUICK.rounds} rounds instead of {FULL.rounds} "
        f"({QUICK.spawn_rounds} instead of {FULL.spawn_rounds} for reshard_load, "
        "trainer_overhead and the export group, which start processes per sample; "
        f"{QUICK.async_rounds} for async_stall and persist_interference in both; "
        f"{QUICK.staging_saves} instead of {FULL.staging_saves} async saves in a row of "
        f"{QUICK.staging_bytes >> 20} instead of {FULL.staging_bytes >> 20} MB for "
        "async_staging_growth), "
        "smaller async/gcs states, shorter training runs, bench.memory_tier's quick mode "
        f"({q.stall_rounds} instead of {f.stall_rounds} stall rounds of {q.stall_steps} "
        f"instead of {f.stall_steps} steps, {q.restore_rounds} instead of {f.restore_rounds} "
        f"restore rounds of a {q.restore_bytes >> 20} MB instead of {f.restore_bytes >> 20} MB "
        f"state), the curves group's quick mode (bench.curves.QUICK: states of "
        f"{' and '.join(str(b >> 20) for b in cq.bytes_sizes)} MB, "
        f"{' and '.join(map(str, cq.tensor_counts))} tensors, "
        f"{' and '.join(map(str, cq.ranks))} ranks, roots of "
        f"{' and '.join(map(str, cq.root_counts))} checkpoints, no restores or kill "
        f"jobs), the scale group at {' and '.join(map(str, sq.ranks))} simulated ranks of "
        f"{sq.tensors} tensors (full: {' to '.join(map(str, (sf.ranks[0], sf.ranks[-1])))} of "
        f"{sf.tensors}); {', '.join(FULL_ONLY[:-1])} and {FULL_ONLY[-1]} are not measured "
        "(full mode only)",
    )
    p.add_argument(
        "--only",
        metavar="GROUP[,GROUP...]",
        type=parse_only,
        default=tuple(m.GROUPS),
        help=f"run only these groups of measurements (default: all). Groups: {groups}. "
        'The metrics of the other groups are reported as NaN, status "not run (--only)"',
    )
    p.add_argument(
        "--json",
        metavar="OUT",
        help=f"write {{metric: {{value, target, ok, detail}}}} for all {len(m.TARGETS)} metrics",
    )
    p.add_argument(
        "--dir", default=None, help="parent of the fresh temp dir (default: the system temp dir)"
    )
    p.add_argument(
        "--plot",
        metavar="DIR",
        default=None,
        help="curves group: write one PNG per cost curve (log-log, ours and DCP, fitted "
        "growth exponents) and curves.json (every series and raw sample) into DIR; "
        "scale group: scale.png (the simulated coordinator, ours and DCP). "
        "`python -m bench curves [options]` runs the curves group alone "
        "(= --only curves)",
    )
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "curves":
        argv = ["--only", "curves", *argv[1:]]
    return p.parse_args(argv)


def _machine(work: str) -> dict[str, Any]:
    st = os.statvfs(work)
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "disk_free_gb": round(st.f_bavail * st.f_frsize / 1e9, 1),
    }


def _guarded(what: str, fn: Callable[[], list[m.Metric]], errors: list[str]) -> list[m.Metric]:
    """Run one task; a failure is printed and added to ``errors``, not fatal (its metrics: NaN)."""
    try:
        return fn()
    except Exception as exc:
        print(f"bench: {what} failed: {exc}"[:3000], file=sys.stderr)
        errors.append(f"{what}: {exc}")
        return []


def why_missing(name: str, selected: tuple[str, ...], errors: dict[str, list[str]]) -> str:
    """``detail.status`` of a metric that was not produced."""
    group = next(g for g, names in m.GROUPS.items() if name in names)
    if group not in selected:
        return "not run (--only)"
    if errors.get(group):
        return f"failed: {'; '.join(errors[group])}"[:500]
    return "not measured (see stderr)"


def _rounds_on_ranks(fn: Callable[..., Any], work: str, mode: Mode) -> dict[str, Any]:
    """``fn(rank, world, work, width, rounds)`` on RANKS spawned ranks; rank 0's result."""
    width = layer_width(mode.total_bytes)
    return run_on_ranks(fn, RANKS, work, width, mode.rounds, timeout_s=mode.timeout_s)[0]


def _save(work: str, mode: Mode) -> list[m.Metric]:
    return m.save_metrics(_rounds_on_ranks(save_rounds, work, mode))


def _load(work: str, mode: Mode) -> list[m.Metric]:
    return [m.load_metric(_rounds_on_ranks(load_rounds, work, mode))]


def _reshard(work: str, mode: Mode) -> list[m.Metric]:
    """One save from RESHARD_FROM ranks, then rounds of {load into RESHARD_FROM, into RESHARD_TO}.

    Every load is its own spawn (order alternating per round); only the load inside
    the ranks is timed.
    """
    width = layer_width(mode.total_bytes)
    saved = run_on_ranks(reshard_save, RESHARD_FROM, work, width, timeout_s=mode.timeout_s)[0]
    loads: list[dict[str, Any]] = []
    for i in range(mode.spawn_rounds):
        worlds = (RESHARD_FROM, RESHARD_TO) if i % 2 == 0 else (RESHARD_TO, RESHARD_FROM)
        for world in worlds:
            out = run_on_ranks(
                reshard_load, world, work, width, saved["digest"], timeout_s=mode.timeout_s
            )
            loads.append(out[0])
    return [m.reshard_metric(saved, loads)]


def _async(work: str, mode: Mode) -> list[m.Metric]:
    raw = run_on_ranks(
        async_rounds,
        RANKS,
        work,
        layer_width(mode.persist_bytes),
        mode.async_rounds,
        WARMUP_STEPS,
        timeout_s=mode.timeout_s,
    )[0]
    staging = run_on_ranks(
        staging_rounds,
        RANKS,
        work,
        layer_width(mode.staging_bytes),
        mode.staging_saves,
        timeout_s=mode.timeout_s,
    )[0]
    return [*m.async_metrics(raw), m.staging_growth_metric(staging)]


def _overhead(work: str, mode: Mode) -> list[m.Metric]:
    trainer_rates: list[float] = []
    plain_rates: list[float] = []
    exits: list[int] = []
    reasons: list[str] = []
    for i in range(mode.spawn_rounds):
        for side in ("trainer", "plain") if i % 2 == 0 else ("plain", "trainer"):
            if side == "trainer":
                ends, rc, why = trainer_run(work, mode.train_steps, timeout_s=mode.timeout_s)
                trainer_rates.append(steady_rate(ends, WARMUP_STEPS))
                exits.append(rc)
                if why:
                    reasons.append(why)
            else:
                out = run_on_ranks(
                    plain_loop, RANKS, mode.train_steps, WARMUP_STEPS, timeout_s=mode.timeout_s
                )[0]
                plain_rates.append(steady_rate(out["ends"], WARMUP_STEPS))
    return [
        m.overhead_metric(
            trainer_rates,
            plain_rates,
            steps_per_run=mode.train_steps,
            warmup_steps_excluded=WARMUP_STEPS,
            trainer_exit_codes=exits,
            trainer_exit_reasons=reasons[:2],
        )
    ]


def _gcs(mode: Mode) -> list[m.Metric]:
    # imported here: the emulator package comes with the bench extra only
    from bench.harness.gcs_emulator import create_bucket, emulator_in_environ, start_emulator

    with emulator_in_environ(start_emulator()) as emulator:
        bucket = "bench"
        create_bucket(emulator.endpoint, bucket)
        raw = run_on_ranks(
            gcs_rounds,
            RANKS,
            bucket,
            layer_width(mode.gcs_bytes),
            mode.rounds,
            timeout_s=mode.timeout_s,
        )[0]
    return m.gcs_metrics(raw)


def _s3(mode: Mode) -> list[m.Metric]:
    # imported here: SeaweedFS and s3fs come with the bench extra only
    from bench.harness.seaweedfs import seaweedfs_in_environ, start_seaweedfs

    with seaweedfs_in_environ(start_seaweedfs()) as server:
        server.create_bucket("bench")
        raw = run_on_ranks(
            s3_rounds, RANKS, "bench", layer_width(mode.s3_bytes), mode.rounds,
            timeout_s=mode.timeout_s,
        )[0]  # fmt: skip
    return m.s3_metrics(raw)


def _replicated(mode: Mode) -> list[m.Metric]:
    from bench.harness.seaweedfs import seaweedfs_in_environ, start_seaweedfs
    from bench.replicated import RANKS as REPLICAS
    from bench.replicated import replicated_rounds

    with seaweedfs_in_environ(start_seaweedfs()) as server:
        server.create_bucket("bench")
        raw = run_on_ranks(
            replicated_rounds, REPLICAS, "bench", mode.replicated_bytes, mode.rounds,
            timeout_s=mode.timeout_s,
        )[0]  # fmt: skip
    return m.replicated_metrics(raw)


def _scale(mode: Mode, plot_dir: str | None) -> list[m.Metric]:
    raw = plan_scale.measure(mode.scale, progress=_progress)
    if plot_dir:
        from bench.curve_plots import plot_curve

        os.makedirs(plot_dir, exist_ok=True)
        plot_curve(plan_scale.curve(raw), os.path.join(plot_dir, "scale.png"), mode.name)
    return m.scale_metrics(raw)


def _memory(work: str, mode: Mode) -> list[m.Metric]:
    return m.memory_metrics(memory_tier.measure(work, mode.memory))


def _export(work: str, mode: Mode) -> list[m.Metric]:
    """export_memory, export_vs_read: ckpt.export of a ``total_bytes`` checkpoint (bench/export.py)."""
    width = layer_width(max(mode.total_bytes, EXPORT_MIN_BYTES))
    raw = export_rounds(work, width, mode.spawn_rounds, mode.timeout_s)
    return export_metrics(raw)


def _curves(work: str, mode: Mode, plot_dir: str | None) -> list[m.Metric]:
    """The cost curves (bench/curves.py), their plots and JSON in ``plot_dir`` when given."""
    return cost_curves.run(work, mode.curves, plot_dir, _progress)


def _not_full(names: tuple[str, ...]) -> list[m.Metric]:
    return [m.missing(name, "full mode only (torchrun jobs of a minute or more)") for name in names]


def _elastic(work: str, mode: Mode) -> list[m.Metric]:
    """restart_overhead, fault_cost_s, ettr: one job with the memory tier, one durable only
    (both through the warm launcher when it is installed, on our rendezvous backend), cold
    inits around them; before them two shorter jobs for the detail of restart_overhead:
    the trainer itself (cold path) and the warm launcher on torchrun's c10d, whose median
    step time sizes the kill plan (:meth:`KillPlan.sized`: a fault about every 30 s)."""
    if not mode.elastic_jobs:
        return _not_full(("restart_overhead", "fault_cost_s", "ettr"))
    warm = warm_available()
    launcher = "warmstart" if warm else "plain"
    cold = [cold_init_s(work)]
    step_times: list[float] = []

    def short_job(launch_warm: bool, backend: str) -> list[dict[str, float]] | str:
        try:
            out = elastic_run(
                work,
                PLAIN_MAX_STEPS,
                PLAIN_KILL_STEPS,
                ELASTIC_CKPT_EVERY,
                mode.timeout_s,
                warm=launch_warm,
                rdzv_backend=backend,
            )
            step_times.extend(float(r["step_time_s"]) for r in out["metrics"])
            return restarts(out["metrics"], out["events"], out["logs"])
        except Exception as exc:
            return f"failed: {exc}"[:500]
        finally:
            cold.append(cold_init_s(work))

    # The shorter jobs first: their step time sizes the kill plan (a fault every ~30 s).
    plain: list[dict[str, float]] | str | None = None
    if warm:  # the cold path beside it: one shorter job through the trainer itself
        _progress(f"elastic: job 1/4, the trainer itself (cold path), rdzv {OURS_RDZV}")
        plain = short_job(False, OURS_RDZV)
    _progress(f"elastic: job 2/4, {launcher} launcher on torchrun's c10d rendezvous")
    c10d = short_job(warm, "c10d")
    plan = KillPlan.sized(statistics.median(step_times)) if step_times else KILL_PLAN
    _progress(
        f"elastic: kill plan {plan.max_steps} steps, kills before {list(plan.kill_steps)}"
        + (f" (median step {statistics.median(step_times):.3f} s)" if step_times else "")
    )
    _progress(f"elastic: job 3/4, memory tier + durable, {launcher} launcher, rdzv {OURS_RDZV}")
    ours = fault_cost_run(
        work, plan, mode.timeout_s, memory=True, warm=warm, rdzv_backend=OURS_RDZV
    )
    cold.append(cold_init_s(work))
    _progress(f"elastic: job 4/4, durable only, {launcher} launcher, rdzv {OURS_RDZV}")
    base = fault_cost_run(
        work, plan, mode.timeout_s, memory=False, warm=warm, rdzv_backend=OURS_RDZV
    )
    cold.append(cold_init_s(work))
    samples = restarts(ours["metrics"], ours["events"], ours["logs"])
    samples += restarts(base["metrics"], base["events"], base["logs"])
    settings = {"launcher": launcher, "rdzv_backend": OURS_RDZV, **plan.settings()}
    runs = [
        {**goodput(job["metrics"], job["events"]), "job_wall_s": job["job_wall_s"]}
        for job in (ours, base)
    ]
    return [
        m.restart_metric(
            samples,
            cold,
            plain_launcher=plain,
            c10d=c10d,
            jobs="the memory-tier and the durable-only job of fault_cost_s",
            **settings,
        ),
        m.fault_cost_metric(
            ours["cost"],
            base["cost"],
            job_wall_s=[round(ours["job_wall_s"], 1), round(base["job_wall_s"], 1)],
            **settings,
        ),
        m.ettr_metric(
            runs[:1],
            mean_s_between_faults=[round(ours["cost"]["mean_s_between_faults"], 1)],
            baseline_goodput=round(runs[1]["goodput"], 4),
            baseline_durable_only=runs[1],
            baseline_mean_s_between_faults=round(base["cost"]["mean_s_between_faults"], 1),
            tiers="memory + durable (baseline_durable_only: the same job without the memory tier)",
            **settings,
        ),
    ]


def _loader(work: str, mode: Mode) -> list[m.Metric]:
    """loader_fault_cost_s, loader_survivor_exit_s: the project's example with two
    ``DataLoader`` worker processes per rank, one agent of two workers, rank 1 killed three
    times (bench/fault_cost.py, :data:`~bench.fault_cost.LOADER_PLAN`)."""
    if not mode.elastic_jobs:
        return _not_full(("loader_fault_cost_s", "loader_survivor_exit_s"))
    if importlib.util.find_spec(LOADER_EXAMPLE.split(".")[0]) is None:
        why = f"needs a source checkout: the job runs {LOADER_EXAMPLE} (not in the wheel)"
        return [m.missing(n, why) for n in ("loader_fault_cost_s", "loader_survivor_exit_s")]
    warm = warm_available()
    plan = LOADER_PLAN
    _progress(
        f"elastic: loader-worker job, {'warmstart' if warm else 'plain'} launcher, rdzv "
        f"{OURS_RDZV}, kills before {list(plan.kill_steps)} of {plan.max_steps} steps"
    )
    job = loader_fault_cost_run(work, plan, mode.timeout_s, warm=warm, rdzv_backend=OURS_RDZV)
    return m.loader_metrics(job, **plan.settings(), kills_of="rank 1 (TRAINER_FAULTS)")


def _silent(work: str, mode: Mode) -> list[m.Metric]:
    if mode.silent_runs == 0:
        return _not_full(("silent_node_loss",))
    silent = []
    warm = warm_available()
    launcher = "warmstart" if warm else "plain"
    for i in range(mode.silent_runs):
        _progress(
            f"silent node: job {i + 1}/{mode.silent_runs}, {launcher} launcher, rdzv {OURS_RDZV}"
        )
        out = silent_node_run(
            work,
            SILENT_MAX_STEPS,
            SILENT_FREEZE_AFTER,
            ELASTIC_CKPT_EVERY,
            mode.timeout_s,
            rdzv_backend=OURS_RDZV,
            warm=warm,
        )
        silent.append(silent_loss(out["metrics"], out["events"], out["logs"], out["frozen_at"]))
    return [
        m.silent_node_metric(
            silent,
            agents=3,
            frozen="SIGSTOP of a non-zero rank's agent and worker",
            freeze_after_step=SILENT_FREEZE_AFTER,
            checkpoint_every_steps=ELASTIC_CKPT_EVERY,
            settings=(
                "default trainer settings (run.peer_timeout_s=5, run.heartbeat_s=0.25, "
                "run.node_timeout_s=1: the frozen node's keep-alive is the second witness)"
            ),
            rdzv_backend=OURS_RDZV,
            launcher=launcher,
        )
    ]


def _rendezvous(mode: Mode) -> list[m.Metric]:
    """rendezvous_vs_c10d: handler-only agents against one store, c10d and ft side by side.

    A phase that does not finish within :func:`rdzv_phase_timeout_s` ends that simulation (the
    row says which phase and how long it ran); a simulation that fails otherwise, or does
    not get its agents started within ``RDZV_SIM_TIMEOUT_S``, is a row with an ``error``,
    and that backend is not run at larger N (a skipped row)."""
    rows: list[dict[str, Any]] = []
    failed: dict[str, int] = {}
    for n in mode.rendezvous_n:
        for backend in rdzv.BACKENDS:
            if backend in failed:
                rows.append(
                    {"backend": backend, "n": n, "error": f"skipped: failed at N={failed[backend]}"}
                )
                continue
            _progress(f"rendezvous: {backend} N={n}")
            t0 = time.monotonic()
            try:
                row = rdzv.simulate(
                    backend,
                    n,
                    timeout_s=min(mode.timeout_s, RDZV_SIM_TIMEOUT_S),
                    phase_timeout_s=rdzv_phase_timeout_s(n),
                )
            except Exception as exc:
                failed[backend] = n
                row = {"backend": backend, "n": n, "error": f"{type(exc).__name__}: {exc}"[:300]}
            row["wall_s"] = round(time.monotonic() - t0, 1)
            _progress(f"rendezvous: {backend} N={n}: {rdzv.describe(row)}")
            rows.append(row)
    return [m.rendezvous_metric(rows)]


_RUN_STARTED: list[float] = []
"""When this run's first task started (``time.monotonic()``): progress lines say the elapsed time."""


def _progress(text: str, elapsed: bool = True) -> None:
    when = (
        f" (elapsed {time.monotonic() - _RUN_STARTED[0]:.0f} s)" if _RUN_STARTED and elapsed else ""
    )
    print(f"bench: {text}{when}", file=sys.stderr, flush=True)


def task_done_line(
    i: int, n: int, group: str, what: str, took_s: float, elapsed_s: float, got: list[m.Metric]
) -> str:
    """The progress line printed when a task ends: its metrics as they landed (or that it
    produced none), its own time and the run's elapsed time."""
    values = ", ".join(
        f"{x.name}={'NaN' if math.isnan(x.value) else f'{x.value:.3f}'}"
        f" ({'ok' if x.ok else 'miss'}, {x.direction} {x.target:g})"
        for x in got
    )
    return (
        f"[{i}/{n}] {group}: {what} done in {took_s:.0f} s "
        f"(elapsed {elapsed_s:.0f} s): {values or 'no metric (see above)'}"
    )


def tasks(
    work: str, mode: Mode, plot_dir: str | None = None
) -> list[tuple[str, str, Callable[[], list[m.Metric]]]]:
    """``(group, what, run)`` in run order; each task that needs one gets its own directory.
    ``plot_dir``: where the curves group writes its plots (None: no plots)."""

    def own(name: str) -> str:
        path = os.path.join(work, name)
        os.makedirs(path, exist_ok=True)
        return path

    return [
        ("save", "save rounds", lambda: _save(own("save"), mode)),
        ("load", "load rounds", lambda: _load(own("load"), mode)),
        ("load", "reshard rounds", lambda: _reshard(own("reshard"), mode)),
        ("async", "async", lambda: _async(work, mode)),
        ("overhead", "trainer_overhead", lambda: _overhead(work, mode)),
        ("gcs", "gcs", lambda: _gcs(mode)),
        ("s3", "s3", lambda: _s3(mode)),
        ("memory", "memory tier", lambda: _memory(own("memory"), mode)),
        ("elastic", "kill jobs", lambda: _elastic(work, mode)),
        ("elastic", "silent node jobs", lambda: _silent(work, mode)),
        ("elastic", "loader-worker job", lambda: _loader(work, mode)),
        ("rendezvous", "rendezvous simulation", lambda: _rendezvous(mode)),
        ("loader", "loader randomness", lambda: loader_metrics()),
        ("export", "export rounds", lambda: _export(own("export"), mode)),
        ("curves", "cost curves", lambda: _curves(own("curves"), mode, plot_dir)),
        ("replicated", "replicated state", lambda: _replicated(mode)),
        ("scale", "planning at scale (simulated)", lambda: _scale(mode, plot_dir)),
    ]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    mode = QUICK if args.quick else FULL
    selected: tuple[str, ...] = args.only
    work = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    run: dict[str, Any] = {
        "mode": mode.name,
        "ranks": RANKS,
        "reshard_ranks": [RESHARD_FROM, RESHARD_TO],
        "width": layer_width(mode.total_bytes),
        "groups": list(selected),
        **_machine(work),
    }
    started = time.monotonic()
    _RUN_STARTED[:] = [started]
    produced: list[m.Metric] = []
    errors: dict[str, list[str]] = {}
    todo = [t for t in tasks(work, mode, args.plot) if t[0] in selected]
    _progress(
        f"mode={mode.name}, {len(todo)} task(s) in group(s) {','.join(selected)}; work dir {work}",
        elapsed=False,
    )
    try:
        for i, (group, what, task) in enumerate(todo, 1):
            _progress(f"[{i}/{len(todo)}] {group}: {what} ...")
            t0 = time.monotonic()
            got = _guarded(what, task, errors.setdefault(group, []))
            produced += got
            _progress(
                task_done_line(
                    i,
                    len(todo),
                    group,
                    what,
                    time.monotonic() - t0,
                    time.monotonic() - started,
                    got,
                ),
                elapsed=False,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = m.complete(produced, lambda name: why_missing(name, selected, errors))
    run["elapsed_s"] = round(time.monotonic() - started, 1)
    print(f"bench: mode={mode.name} groups={','.join(selected)} elapsed={run['elapsed_s']} s")
    print(markdown_table(results))
    if args.json:
        write_json(args.json, results, run)
    failed = {group: why for group, why in errors.items() if why}
    for group, why in failed.items():
        print(f"bench: group {group} failed to produce its metrics: {'; '.join(why)}"[:2000])
    return 1 if failed else 0  # a missed target is a result, not a failure


if __name__ == "__main__":
    sys.exit(main())
