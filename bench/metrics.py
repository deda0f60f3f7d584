"""Turn the raw samples of :mod:`bench.rounds` into metrics: ``{value, target, ok, detail}``.

Pure functions, no I/O. Times are medians of the steady-state rounds (round 0 of
the save rounds is the warm-up, reported apart in ``detail``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

NOT_MEASURED = (
    ("trainer_overhead", 0.98, ">="),
    ("async_stall", 0.05, "<="),
    ("persist_interference", 1.10, "<="),
    ("restart_overhead", 2.0, "<="),
    ("ettr", 0.90, ">="),
    ("gcs_save_vs_pipe", 0.80, ">="),
)


@dataclass(slots=True, kw_only=True)
class Metric:
    name: str
    value: float
    target: float
    direction: str  # "<=" or ">=": which side of the target passes
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        if math.isnan(self.value):
            return False
        return self.value <= self.target if self.direction == "<=" else self.value >= self.target

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "ok": self.ok, "detail": self.detail}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def _r(x: float, nd: int = 4) -> float:
    return round(x, nd)


def save_metrics(raw: dict[str, Any]) -> list[Metric]:
    t = raw["times"]
    ours, dcp, dd, tsave = (t[k][1:] for k in ("ours", "dcp", "dd", "torch_save"))
    ours_s, dcp_s, dd_s = _median(ours), _median(dcp), _median(dd)
    ours_bytes = raw["ours_bytes"][-1]
    dd_bytes = raw["dd_bytes"][-1]
    ours_bps = ours_bytes / ours_s
    dd_bps = dd_bytes / dd_s
    growth = raw["rank_mem_growth"]
    state_bytes = raw["rank_state_bytes"]
    per_rank = [max(g) / b for g, b in zip(growth, state_bytes, strict=True)]
    steady = [max(g[1:]) / b for g, b in zip(growth, state_bytes, strict=True) if len(g) > 1]
    return [
        Metric(
            name="save_vs_dcp",
            value=ours_s / dcp_s,
            target=1.0,
            direction="<=",
            detail={
                "ours_median_s": _r(ours_s),
                "dcp_median_s": _r(dcp_s),
                "ours_first_save_s": _r(t["ours"][0]),
                "dcp_first_save_s": _r(t["dcp"][0]),
                "torch_save_full_median_s": _r(_median(tsave)),
                "torch_save_full_first_s": _r(t["torch_save"][0]),
                "torch_save_full_bytes": raw["full_bytes"],
                "checkpoint_bytes": ours_bytes,
                "ours_samples_s": [_r(x) for x in ours],
                "dcp_samples_s": [_r(x) for x in dcp],
                "ranks": raw["world"],
                "fsync": "ours: fsync per shard + dir; dcp: FileSystemWriter sync_files=True",
            },
        ),
        Metric(
            name="save_vs_disk",
            value=ours_bps / dd_bps,
            target=0.80,
            direction=">=",
            detail={
                "ours_MBps": _r(ours_bps / 1e6, 1),
                "dd_MBps": _r(dd_bps / 1e6, 1),
                "ours_bytes": ours_bytes,
                "dd_bytes": dd_bytes,
                "dd_median_s": _r(dd_s),
                "dd_first_s": _r(t["dd"][0]),
                "dd_samples_s": [_r(x) for x in dd],
                "baseline": "dd if=/dev/zero bs=4M conv=fdatasync, one per rank in parallel",
            },
        ),
        Metric(
            name="save_memory",
            value=max(per_rank),
            target=0.5,
            direction="<=",
            detail={
                "rank_state_bytes": state_bytes,
                "rank_peak_rss_growth_bytes": [max(g) for g in growth],
                "first_save_ratio": _r(
                    max(g[0] / b for g, b in zip(growth, state_bytes, strict=True))
                ),
                "steady_ratio": _r(max(steady)) if steady else None,
                "method": "sampling thread on /proc/self/statm every 2 ms; max over rounds and ranks",
            },
        ),
    ]


def load_metrics(raw: dict[str, Any]) -> list[Metric]:
    t = raw["times"]
    cold_ours, cold_dd = _median(t["cold_ours"]), _median(t["cold_dd"])
    same, reshard = _median(t["warm_same"]), _median(t["reshard"])
    ours_bps = raw["total_bytes"] / cold_ours
    dd_bps = raw["shard_bytes"] / cold_dd
    return [
        Metric(
            name="load_vs_disk",
            value=ours_bps / dd_bps,
            target=0.75,
            direction=">=",
            detail={
                "ours_MBps": _r(ours_bps / 1e6, 1),
                "dd_MBps": _r(dd_bps / 1e6, 1),
                "ours_median_s": _r(cold_ours),
                "dd_median_s": _r(cold_dd),
                "checkpoint_bytes": raw["total_bytes"],
                "ours_bytes_read": raw["ours_bytes_read"][-1] if raw["ours_bytes_read"] else None,
                "dd_bytes": raw["shard_bytes"],
                "cache_drop": raw["cache_drop"],
                "baseline": "dd if=SHARD of=/dev/null bs=4M, one per rank in parallel, cold",
            },
        ),
        Metric(
            name="reshard_load",
            value=reshard / same,
            target=1.2,
            direction="<=",
            detail={
                "reshard_median_s": _r(reshard),
                "same_world_median_s": _r(same),
                "reshard": f"{raw.get('saved_world', 2)} -> 1 ranks, full state on one rank",
                "cache": "warm (both sides), so the ratio is the resharding cost, not the disk",
                "note": "the 1-rank load reads every byte alone; 2 ranks read half each",
            },
        ),
    ]


def not_measured(done: set[str]) -> list[Metric]:
    return [
        Metric(
            name=name,
            value=math.nan,
            target=target,
            direction=direction,
            detail={"status": "not measured yet"},
        )
        for name, target, direction in NOT_MEASURED
        if name not in done
    ]


def missing(name: str, target: float, direction: str, why: str) -> Metric:
    return Metric(
        name=name, value=math.nan, target=target, direction=direction, detail={"status": why}
    )
