"""``python -m bench [--quick] [--json OUT] [--dir DIR]``: measure, print a table, write JSON."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from bench import metrics as m
from bench.fsdp_state import layer_width
from bench.report import markdown_table, write_json
from bench.rounds import load_rounds, save_rounds
from bench.spawn import RankFailedError, run_on_ranks

RANKS = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class Mode:
    name: str
    total_bytes: int
    """Checkpoint size over all ranks (model + AdamW state, fp32)."""
    rounds: int
    """Steady-state repetitions per measurement (medians); saves add one warm-up."""
    timeout_s: float


QUICK = Mode(name="quick", total_bytes=64 << 20, rounds=3, timeout_s=150)
FULL = Mode(name="full", total_bytes=1 << 30, rounds=5, timeout_s=900)


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
    finally:
        shutil.rmtree(work, ignore_errors=True)
    order = [
        "save_vs_dcp",
        "save_vs_disk",
        "load_vs_disk",
        "reshard_load",
        "save_memory",
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
