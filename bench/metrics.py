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


def _flat(per_rank: list[list[list[float]]]) -> list[list[float]]:
    """Per round, the slowest rank's step times (step i of the round, max over ranks)."""
    rounds = []
    for r in range(len(per_rank[0])):
        steps = zip(*(rank[r] for rank in per_rank), strict=True)
        rounds.append([max(s) for s in steps])
    return rounds


def async_metrics(raw: dict[str, Any]) -> list[Metric]:
    sync, block = raw["sync_s"], raw["async_block_s"]
    steady_sync, steady_block = _median(sync[1:]), _median(block[1:])
    quiet = [statistics.mean(r) for r in _flat(raw["quiet_steps_s"])]
    busy = [statistics.mean(r) for r in _flat(raw["busy_steps_s"])]
    quiet_s, busy_s = _median(quiet), _median(busy)
    return [
        Metric(
            name="async_stall",
            value=steady_block / steady_sync,
            target=0.05,
            direction="<=",
            detail={
                "ours_median_s": _r(steady_block),
                "sync_median_s": _r(steady_sync),
                "first_save_ratio": _r(block[0] / sync[0]),
                "first_async_block_s": _r(block[0]),
                "first_sync_s": _r(sync[0]),
                "async_reported_blocking_s": [_r(x) for x in raw["async_reported_s"]],
                "async_samples_s": [_r(x) for x in block],
                "sync_samples_s": [_r(x) for x in sync],
                "async_total_s": [_r(x) for x in raw["async_total_s"]],
                "state_bytes": raw["state_bytes"],
                "steady": "rounds 1.. (staging buffers reused); round 0 allocates them",
            },
        ),
        Metric(
            name="persist_interference",
            value=busy_s / quiet_s,
            target=1.10,
            direction="<=",
            detail={
                "busy_step_s": _r(busy_s),
                "quiet_step_s": _r(quiet_s),
                "busy_round_means_s": [_r(x) for x in busy],
                "quiet_round_means_s": [_r(x) for x in quiet],
                "busy_steps_per_round": [len(r) for r in raw["busy_steps_s"][0]],
                "persist_s": [_r(x) for x in raw["persist_s"]],
                "persisted_bytes": raw["state_bytes"],
                "model": "examples/tiny_gpt.toml GPT, 2 ranks, trainer.loop.train_step",
            },
        ),
    ]


def overhead_metric(trainer_rates: list[float], plain_rates: list[float], **extra: Any) -> Metric:
    t, p = _median(trainer_rates), _median(plain_rates)
    return Metric(
        name="trainer_overhead",
        value=t / p,
        target=0.98,
        direction=">=",
        detail={
            "trainer_steps_per_s": _r(t),
            "plain_steps_per_s": _r(p),
            "trainer_samples": [_r(x) for x in trainer_rates],
            "plain_samples": [_r(x) for x in plain_rates],
            **extra,
        },
    )


def gcs_metric(raw: dict[str, Any]) -> Metric:
    ours_s, pipe_s = _median(raw["ours_s"][1:]), _median(raw["pipe_s"][1:])
    ours_bps = raw["ours_bytes"][-1] / ours_s
    pipe_bps = raw["pipe_bytes"] / pipe_s
    return Metric(
        name="gcs_save_vs_pipe",
        value=ours_bps / pipe_bps,
        target=0.80,
        direction=">=",
        detail={
            "ours_MBps": _r(ours_bps / 1e6, 1),
            "pipe_MBps": _r(pipe_bps / 1e6, 1),
            "ours_median_s": _r(ours_s),
            "pipe_median_s": _r(pipe_s),
            "ours_first_save_s": _r(raw["ours_s"][0]),
            "ours_samples_s": [_r(x) for x in raw["ours_s"]],
            "pipe_samples_s": [_r(x) for x in raw["pipe_s"]],
            "checkpoint_bytes": raw["ours_bytes"][-1],
            "pipe_bytes": raw["pipe_bytes"],
            "baseline": "gcsfs pipe of one object per rank, 2 ranks in parallel, fake-gcs-server",
        },
    )


def restart_metric(samples: list[dict[str, float]], cold_s: list[float], **extra: Any) -> Metric:
    overhead = _median([s["overhead_s"] for s in samples])
    cold = _median(cold_s)
    keys = ("restart_to_first_step_s", "detect_s", "rdzv_spawn_import_pg_s", "build_s", "load_s",
            "up_to_load_s", "start_event_to_first_row_s", "first_step_s")  # fmt: skip
    breakdown = {f"median_{k}": _r(_median([s[k] for s in samples if k in s])) for k in keys}
    return Metric(
        name="restart_overhead",
        value=overhead / cold,
        target=2.0,
        direction="<=",
        detail={
            "ours_median_s": _r(overhead),
            "cold_init_median_s": _r(cold),
            "cold_init_samples_s": [_r(x) for x in cold_s],
            **breakdown,
            "restarts": [
                {k: _r(v) if isinstance(v, float) else v for k, v in s.items()} for s in samples
            ],
            **extra,
        },
    )


def ettr_metric(runs: list[dict[str, Any]], **extra: Any) -> Metric:
    return Metric(
        name="ettr",
        value=_median([r["goodput"] for r in runs]),
        target=0.90,
        direction=">=",
        detail={"runs": runs, **extra},
    )
