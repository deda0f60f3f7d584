"""Output of a run: a markdown table on stdout and the ``--json`` object."""

from __future__ import annotations

import json
import math
from typing import Any

from bench.metrics import Metric

_SUMMARY_KEYS = (
    "ours_median_s",
    "dcp_median_s",
    "torch_save_full_median_s",
    "ours_first_save_s",
    "ours_MBps",
    "dd_MBps",
    "reshard_median_s",
    "same_world_median_s",
    "first_save_ratio",
    "sync_median_s",
    "trainer_steps_per_s",
    "plain_steps_per_s",
    "busy_step_s",
    "quiet_step_s",
    "pipe_MBps",
    "step_median_s_without",
    "memory_peer_median_s",
    "disk_cold_median_s",
    "launcher",
    "cold_init_median_s",
    "plain_launcher_value",
    "median_load_s",
    "median_up_to_load_s",
    "baseline_fault_cost_s",
    "mean_s_between_faults",
    "baseline_goodput",
    "cache_drop",
    "read_by_each_amplification",
    "once_median_s",
    "each_median_s",
    "status",
)


def markdown_table(metrics: list[Metric]) -> str:
    lines = [
        "| metric | value | target | ok | detail |",
        "|---|---:|---:|:---:|---|",
    ]
    for m in metrics:
        value = "NaN" if math.isnan(m.value) else f"{m.value:.3f}"
        summary = ", ".join(f"{k}={m.detail[k]}" for k in _SUMMARY_KEYS if k in m.detail)
        ok = "yes" if m.ok else "no"
        lines.append(f"| {m.name} | {value} | {m.direction} {m.target:g} | {ok} | {summary} |")
    return "\n".join(lines)


def write_json(path: str, metrics: list[Metric], run: dict[str, Any]) -> None:
    obj: dict[str, Any] = {m.name: m.to_json() for m in metrics}
    # Run facts (mode, machine) ride along in each metric's detail, so the top level
    # stays exactly one entry per metric.
    for m in obj.values():
        m["detail"] = {**m["detail"], "run": run}
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
