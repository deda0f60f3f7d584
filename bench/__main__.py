"""``python -m bench [--quick] [--json OUT] [--dir DIR]``: measure, print a table, write JSON."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench import metrics as m
from bench.async_rounds import async_rounds
from bench.elastic_runs import cold_init_s, elastic_run, goodput, restarts
from bench.fsdp_state import layer_width
from bench.gcs import GcsEmulator, gcs_rounds
from bench.report import markdown_table, write_json
from bench.rounds import load_rounds, save_rounds
from bench.spawn import RankFailedError, run_on_ranks
from bench.train_loop import plain_loop, steady_rate, trainer_run

RANKS = 2


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
    train_steps: int
    """Steps per trainer / plain-loop run (trainer_overhead); the first 5 are warm-up."""
    elastic_runs: int
    """2-agent torchrun jobs with 3 kills each (restart_overhead, ettr); 0: not run."""


QUICK = Mode(
    name="quick",
    total_bytes=64 << 20,
    rounds=3,
    timeout_s=150,
    persist_bytes=256 << 20,
    gcs_bytes=64 << 20,
    train_steps=15,
    elastic_runs=0,
)
FULL = Mode(
    name="full",
    total_bytes=1 << 30,
    rounds=5,
    timeout_s=900,
    persist_bytes=1 << 30,
    gcs_bytes=256 << 20,
    train_steps=45,
    elastic_runs=2,
)
WARMUP_STEPS = 5
KILL_STEPS = [20, 45, 70]
ELASTIC_MAX_STEPS = 90
ELASTIC_CKPT_EVERY = 10


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="~64 MB state, 3 rounds (under 3 min)")
    p.add_argument("--json", metavar="OUT", help="write {metric: {value, target, ok, detail}}")
    p.add_argument(
        "--dir", default=None, help="parent of the fresh temp dir (default: the system temp dir)"
    )
    return p.parse_args(argv)


def _machine(work: str) -> dict[str, Any]:
    st = os.statvfs(work)
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "disk_free_gb": round(st.f_bavail * st.f_frsize / 1e9, 1),
    }


def _guarded(what: str, fn: Callable[[], list[m.Metric]]) -> list[m.Metric]:
    """Run one group of measurements; a failure is reported, not fatal (its metrics stay NaN)."""
    try:
        return fn()
    except Exception as exc:
        print(f"bench: {what} failed: {exc}"[:3000], file=sys.stderr)
        return []


def _async(work: str, mode: Mode) -> list[m.Metric]:
    raw = run_on_ranks(
        async_rounds,
        RANKS,
        work,
        layer_width(mode.persist_bytes),
        mode.rounds,
        WARMUP_STEPS,
        timeout_s=mode.timeout_s,
    )[0]
    return m.async_metrics(raw)


def _overhead(work: str, mode: Mode) -> list[m.Metric]:
    trainer_rates: list[float] = []
    plain_rates: list[float] = []
    exits: list[int] = []
    reasons: list[str] = []
    for i in range(mode.rounds):
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
    emulator = GcsEmulator()
    saved = {k: os.environ.get(k) for k in emulator.env()}
    os.environ.update(emulator.env())
    try:
        bucket = "bench"
        emulator.create_bucket(bucket)
        raw = run_on_ranks(
            gcs_rounds,
            RANKS,
            bucket,
            layer_width(mode.gcs_bytes),
            mode.rounds,
            timeout_s=mode.timeout_s,
        )[0]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        emulator.stop()
    return [m.gcs_metric(raw)]


def _elastic(work: str, mode: Mode) -> list[m.Metric]:
    if mode.elastic_runs == 0:
        return [
            m.missing("restart_overhead", 2.0, "<=", "full mode only (~1 min per torchrun job)"),
            m.missing("ettr", 0.90, ">=", "full mode only"),
        ]
    samples: list[dict[str, float]] = []
    cold: list[float] = []
    runs: list[dict[str, Any]] = []
    for _ in range(mode.elastic_runs):
        cold.append(cold_init_s(work))
        out = elastic_run(
            work, ELASTIC_MAX_STEPS, KILL_STEPS, ELASTIC_CKPT_EVERY, timeout_s=mode.timeout_s
        )
        samples += restarts(out["metrics"], out["events"], out["logs"])
        runs.append({**goodput(out["metrics"], out["events"]), "job_wall_s": out["job_wall_s"]})
        cold.append(cold_init_s(work))
    settings = {
        "kill_steps": KILL_STEPS,
        "max_steps": ELASTIC_MAX_STEPS,
        "checkpoint_every_steps": ELASTIC_CKPT_EVERY,
        "checkpoint": "async",
        "agents": 2,
    }
    mean_gap = [r["wall_time_s"] / (len(KILL_STEPS) + 1) for r in runs]
    return [
        m.restart_metric(samples, cold, **settings),
        m.ettr_metric(runs, mean_s_between_faults=[round(x, 1) for x in mean_gap], **settings),
    ]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    mode = QUICK if args.quick else FULL
    width = layer_width(mode.total_bytes)
    work = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    run: dict[str, Any] = {"mode": mode.name, "ranks": RANKS, "width": width, **_machine(work)}
    started = time.monotonic()
    results: list[m.Metric] = []
    try:
        try:
            raw = run_on_ranks(
                save_rounds, RANKS, work, width, mode.rounds, timeout_s=mode.timeout_s
            )[0]
            results += m.save_metrics(raw)
        except RankFailedError as exc:
            print(f"bench: save rounds failed: {exc}", file=sys.stderr)
            for name, target, direction in (
                ("save_vs_dcp", 1.0, "<="),
                ("save_vs_disk", 0.8, ">="),
                ("save_memory", 0.5, "<="),
            ):
                results.append(m.missing(name, target, direction, f"failed: {exc}"[:500]))
        if os.path.isdir(os.path.join(work, "ours_last")):
            try:
                raw = run_on_ranks(
                    load_rounds, RANKS, work, width, mode.rounds, timeout_s=mode.timeout_s
                )[0]
                results += m.load_metrics(raw)
            except RankFailedError as exc:
                print(f"bench: load rounds failed: {exc}", file=sys.stderr)
        done = {r.name for r in results}
        for name, target, direction in (("load_vs_disk", 0.75, ">="), ("reshard_load", 1.2, "<=")):
            if name not in done:
                results.append(m.missing(name, target, direction, "not measured (see stderr)"))
        results += _guarded("async", lambda: _async(work, mode))
        results += _guarded("trainer_overhead", lambda: _overhead(work, mode))
        results += _guarded("gcs", lambda: _gcs(mode))
        results += _guarded("elastic", lambda: _elastic(work, mode))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    order = [
        "save_vs_dcp",
        "save_vs_disk",
        "load_vs_disk",
        "reshard_load",
        "save_memory",
        "trainer_overhead",
        "async_stall",
        "persist_interference",
        "restart_overhead",
        "ettr",
        "gcs_save_vs_pipe",
    ]
    results.sort(key=lambda r: order.index(r.name))
    results += m.not_measured({r.name for r in results})
    run["elapsed_s"] = round(time.monotonic() - started, 1)
    print(f"bench: mode={mode.name} ranks={RANKS} elapsed={run['elapsed_s']} s")
    print(markdown_table(results))
    if args.json:
        write_json(args.json, results, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
