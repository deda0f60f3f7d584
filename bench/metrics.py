"""Turn the raw samples of :mod:`bench.rounds` into metrics: ``{value, target, ok, detail}``.

Pure functions, no I/O. Times are medians of the steady-state rounds (round 0 of
the save rounds is the warm-up, reported apart in ``detail``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TARGETS: dict[str, tuple[float, str]] = {
    "save_vs_dcp": (1.0, "<="),
    "save_vs_disk": (0.80, ">="),
    "load_vs_disk": (0.75, ">="),
    "reshard_load": (1.2, "<="),
    "save_memory": (0.5, "<="),
    "trainer_overhead": (0.98, ">="),
    "async_stall": (0.05, "<="),
    "persist_interference": (1.10, "<="),
    "async_staging_growth": (0.05, "<="),
    "memory_tier_stall": (0.02, "<="),
    "peer_restore_vs_disk": (0.5, "<="),
    "restart_overhead": (1.2, "<="),
    "fault_cost_s": (2.0, "<="),
    "ettr": (0.92, ">="),
    "silent_node_loss": (2.0, "<="),
    "loader_fault_cost_s": (1.5, "<="),
    "loader_survivor_exit_s": (0.5, "<="),
    "rendezvous_vs_c10d": (0.33, "<="),
    "loader_resume_exact": (1.0, ">="),
    "loader_seed_overhead": (1.2, "<="),
    "export_memory": (2.0, "<="),
    "export_vs_read": (0.8, ">="),
    "gcs_load_vs_cat": (1.3, ">="),
    "gcs_save_vs_pipe": (1.3, ">="),
    "s3_save_vs_put": (1.3, ">="),
    "s3_load_vs_get": (1.3, ">="),
    "curve_save_bytes_exp": (1.05, "<="),
    "curve_load_bytes_exp": (1.05, "<="),
    "curve_save_tensors_exp": (1.05, "<="),
    "curve_load_tensors_exp": (1.05, "<="),
    "curve_vs_dcp": (1.0, "<="),
    "curve_many_tensors_vs_dcp": (0.5, "<="),
    "curve_rank0_share_exp": (0.2, "<="),
    "curve_discovery_local": (2.0, "<="),
    "curve_discovery_gcs": (2.0, "<="),
    "curve_discovery_s3": (2.0, "<="),
    "curve_save_memory": (0.5, "<="),
    "read_amplification": (1.05, "<="),
    "read_once_load_vs_each": (1.0, "<="),
    "plan_scale_vs_dcp": (0.1, "<="),
    "plan_scale_rank_exp": (1.05, "<="),
    "plan_bytes_per_rank": (0.1, "<="),
}
"""The one table of metrics: name -> (target, direction), in report order.

``"<="`` passes at or below the target, ``">="`` at or above it. :class:`Metric`
takes its target and direction from here, so no other place states them.
"""

GROUPS: dict[str, tuple[str, ...]] = {
    "save": ("save_vs_dcp", "save_vs_disk", "save_memory"),
    "load": ("load_vs_disk", "reshard_load"),
    "async": ("async_stall", "persist_interference", "async_staging_growth"),
    "overhead": ("trainer_overhead",),
    "gcs": ("gcs_save_vs_pipe", "gcs_load_vs_cat"),
    "s3": ("s3_save_vs_put", "s3_load_vs_get"),
    "memory": ("memory_tier_stall", "peer_restore_vs_disk"),
    "elastic": (
        "restart_overhead",
        "fault_cost_s",
        "ettr",
        "silent_node_loss",
        "loader_fault_cost_s",
        "loader_survivor_exit_s",
    ),
    "rendezvous": ("rendezvous_vs_c10d",),
    "loader": ("loader_resume_exact", "loader_seed_overhead"),
    "export": ("export_memory", "export_vs_read"),
    "curves": (
        "curve_save_bytes_exp",
        "curve_load_bytes_exp",
        "curve_save_tensors_exp",
        "curve_load_tensors_exp",
        "curve_vs_dcp",
        "curve_many_tensors_vs_dcp",
        "curve_rank0_share_exp",
        "curve_discovery_local",
        "curve_discovery_gcs",
        "curve_discovery_s3",
        "curve_save_memory",
    ),
    "replicated": ("read_amplification", "read_once_load_vs_each"),
    "scale": ("plan_scale_vs_dcp", "plan_scale_rank_exp", "plan_bytes_per_rank"),
}
"""Measurement groups (``python -m bench --only``), in run order, and the metrics each yields."""


@dataclass(slots=True, kw_only=True)
class Metric:
    name: str
    """A key of :data:`TARGETS`; any other name raises KeyError on construction."""
    value: float
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in TARGETS:
            raise KeyError(f"unknown metric {self.name!r}; known: {', '.join(TARGETS)}")

    @property
    def target(self) -> float:
        return TARGETS[self.name][0]

    @property
    def direction(self) -> str:
        """``"<="`` or ``">="``: which side of the target passes."""
        return TARGETS[self.name][1]

    @property
    def ok(self) -> bool:
        if math.isnan(self.value):
            return False
        return self.value <= self.target if self.direction == "<=" else self.value >= self.target

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "ok": self.ok, "detail": self.detail}


def missing(name: str, why: str) -> Metric:
    """A metric with no value (NaN, never ok); ``detail.status`` says why."""
    return Metric(name=name, value=math.nan, detail={"status": why})


def complete(produced: list[Metric], why: Callable[[str], str]) -> list[Metric]:
    """Exactly one metric per :data:`TARGETS` entry, in the table's order.

    A produced metric is kept (the first one, if a name came twice); every other
    name becomes ``missing(name, why(name))``.
    """
    by_name: dict[str, Metric] = {}
    for metric in produced:
        by_name.setdefault(metric.name, metric)
    return [by_name[name] if name in by_name else missing(name, why(name)) for name in TARGETS]


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


def _throughput_ratio(
    ours_bytes: int,
    ours_samples: list[float],
    base: str,
    base_bytes: int,
    base_samples: list[float],
) -> tuple[float, dict[str, Any]]:
    """ours bytes/s / ``base`` bytes/s from the medians of steady-state samples, and the
    detail fields both sides share (``{side}_MBps``, ``{side}_median_s``, samples)."""
    ours_s, base_s = _median(ours_samples), _median(base_samples)
    ours_bps, base_bps = ours_bytes / ours_s, base_bytes / base_s
    return ours_bps / base_bps, {
        "ours_MBps": _r(ours_bps / 1e6, 1),
        f"{base}_MBps": _r(base_bps / 1e6, 1),
        "ours_median_s": _r(ours_s),
        f"{base}_median_s": _r(base_s),
    }


def load_metric(raw: dict[str, Any]) -> Metric:
    """load_vs_disk from :func:`bench.rounds.load_rounds` (cold loads vs cold ``dd`` reads)."""
    t = raw["times"]
    value, shared = _throughput_ratio(
        raw["total_bytes"], t["cold_ours"], "dd", raw["shard_bytes"], t["cold_dd"]
    )
    return Metric(
        name="load_vs_disk",
        value=value,
        detail={
            **shared,
            "ours_samples_s": [_r(x) for x in t["cold_ours"]],
            "dd_samples_s": [_r(x) for x in t["cold_dd"]],
            "checkpoint_bytes": raw["total_bytes"],
            "ours_bytes_read": raw["ours_bytes_read"][-1] if raw["ours_bytes_read"] else None,
            "dd_bytes": raw["shard_bytes"],
            "ranks": raw["world"],
            "cache_drop": raw["cache_drop"],
            "baseline": "dd if=SHARD of=/dev/null bs=4M, one per rank in parallel, cold",
        },
    )


def reshard_metric(saved: dict[str, Any], loads: list[dict[str, Any]]) -> Metric:
    """reshard_load: load time into fewer ranks / load time into the saving world size.

    ``saved``: what :func:`bench.rounds.reshard_save` returned (``world``,
    ``checkpoint_bytes``); ``loads``: one :func:`bench.rounds.reshard_load` result
    per spawned load (``world``, ``load_s``, ``bytes_read``, ``cache_drop``), in run
    order. Every world size other than ``saved["world"]`` is the resharding side.
    """
    same_world = saved["world"]
    same = [x for x in loads if x["world"] == same_world]
    other = [x for x in loads if x["world"] != same_world]
    worlds = sorted({x["world"] for x in other})
    if len(worlds) > 1:
        raise ValueError(f"one resharding world size expected, got {worlds}")
    to_world = worlds[0] if worlds else None
    same_s = _median([x["load_s"] for x in same])
    reshard_s = _median([x["load_s"] for x in other])
    return Metric(
        name="reshard_load",
        value=reshard_s / same_s,
        detail={
            "reshard_median_s": _r(reshard_s),
            "same_world_median_s": _r(same_s),
            "reshard_samples_s": [_r(x["load_s"]) for x in other],
            "same_world_samples_s": [_r(x["load_s"]) for x in same],
            "reshard": f"{same_world} -> {to_world} ranks",
            "same_world": f"{same_world} -> {same_world} ranks",
            "saved_world": same_world,
            "load_worlds": [x["world"] for x in loads],
            "checkpoint_bytes": saved["checkpoint_bytes"],
            "reshard_bytes_read": sorted({x["bytes_read"] for x in other}),
            "same_world_bytes_read": sorted({x["bytes_read"] for x in same}),
            "cache_drop": sorted({x["cache_drop"] for x in loads}),
            "cache": "cold on both sides: page cache dropped before every timed load",
            "timing": "barrier -> ckpt.load -> barrier inside the ranks (slowest rank); "
            "spawning, the state build and one untimed warm-up load per spawn excluded",
            "state": "FSDP2 MLP + AdamW, same layer width on both sides; loaded values "
            "checked against the saved ones (sha256 of every full tensor)",
        },
    )


def _flat(per_rank: list[list[list[float]]]) -> list[list[float]]:
    """Per round, the slowest rank's step times (step i of the round, max over ranks)."""
    rounds = []
    for r in range(len(per_rank[0])):
        steps = zip(*(rank[r] for rank in per_rank), strict=True)
        rounds.append([max(s) for s in steps])
    return rounds


def staging_growth_metric(raw: dict[str, Any]) -> Metric:
    """RSS growth from the first async save to the last of a row, on the rank that grew
    most: (last - first) / first."""
    per_rank = raw["rss_mib"]
    growth = [(rss[-1] - rss[0]) / rss[0] for rss in per_rank]
    return Metric(
        name="async_staging_growth",
        value=max(growth),
        detail={
            "saves": len(per_rank[0]),
            "state_bytes": raw["state_bytes"],
            "rss_first_mib": [_r(rss[0]) for rss in per_rank],
            "rss_last_mib": [_r(rss[-1]) for rss in per_rank],
            "rss_peak_mib": [_r(max(rss)) for rss in per_rank],
            "growth_per_rank": [_r(g) for g in growth],
            "baseline": "RSS after the first save (its staging buffers allocated)",
        },
    )


def async_metrics(raw: dict[str, Any]) -> list[Metric]:
    sync, block = raw["sync_s"], raw["async_block_s"]
    steady_sync, steady_block = _median(sync[1:]), _median(block[1:])
    overlap = raw["overlap_block_s"]
    steady_overlap = _median(overlap[1:])
    quiet = [statistics.mean(r) for r in _flat(raw["quiet_steps_s"])]
    busy = [statistics.mean(r) for r in _flat(raw["busy_steps_s"])]
    quiet_s, busy_s = _median(quiet), _median(busy)
    return [
        Metric(
            name="async_stall",
            value=steady_overlap / steady_sync,
            detail={
                "ours_median_s": _r(steady_overlap),
                "sync_median_s": _r(steady_sync),
                "mode": "overlap_staging=optimizer: call + optimizer.step() wait for the copy",
                "first_save_ratio": _r(overlap[0] / sync[0]),
                "overlap_samples_s": [_r(x) for x in overlap],
                "overlap_call_s": [_r(x) for x in raw["overlap_call_s"]],
                "overlap_gate_wait_s": [_r(x) for x in raw["overlap_gate_s"]],
                "step_with_copy_s": [_r(x) for x in raw["overlap_step_s"]],
                "step_without_save_s": [_r(x) for x in raw["plain_step_s"]],
                "mlp_batch": raw["mlp_batch"],
                "staging_in_call_ratio": _r(steady_block / steady_sync),
                "staging_in_call_median_s": _r(steady_block),
                "staging_in_call_first_ratio": _r(block[0] / sync[0]),
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
        detail={
            "trainer_steps_per_s": _r(t),
            "plain_steps_per_s": _r(p),
            "trainer_samples": [_r(x) for x in trainer_rates],
            "plain_samples": [_r(x) for x in plain_rates],
            **extra,
        },
    )


def store_save_metric(name: str, raw: dict[str, Any], base: str, baseline: str) -> Metric:
    """``ckpt.save`` to an object store vs one raw upload of as many bytes per rank, from
    :func:`bench.object_store.store_rounds` (``base`` names the raw side in the detail)."""
    value, shared = _throughput_ratio(
        raw["ours_bytes"][-1], raw["ours_s"][1:], base, raw["put_bytes"], raw["put_s"][1:]
    )
    return Metric(
        name=name,
        value=value,
        detail={
            **shared,
            "ours_first_save_s": _r(raw["ours_s"][0]),
            "ours_samples_s": [_r(x) for x in raw["ours_s"]],
            f"{base}_samples_s": [_r(x) for x in raw["put_s"]],
            **_forced_parts(raw),
            "checkpoint_bytes": raw["ours_bytes"][-1],
            f"{base}_bytes": raw["put_bytes"],
            "baseline": baseline,
        },
    )


def _forced_parts(raw: dict[str, Any]) -> dict[str, Any]:
    """The same saves with every shard sent as parallel parts (a side figure)."""
    if not raw.get("parts_s"):
        return {}
    parts_s = _median(raw["parts_s"][1:] or raw["parts_s"])
    return {
        "forced_parts_MBps": _r(raw["ours_bytes"][-1] / parts_s / 1e6, 1),
        "forced_parts_samples_s": [_r(x) for x in raw["parts_s"]],
    }


def store_load_metric(name: str, raw: dict[str, Any], base: str, baseline: str) -> Metric:
    """A cold ``ckpt.load`` from an object store vs one raw download per rank of the object
    the raw upload wrote (:func:`bench.object_store.store_rounds`)."""
    value, shared = _throughput_ratio(
        raw["load_bytes"][-1], raw["load_s"][1:], base, raw["put_bytes"], raw["get_s"][1:]
    )
    return Metric(
        name=name,
        value=value,
        detail={
            **shared,
            "ours_first_load_s": _r(raw["load_s"][0]),
            "ours_samples_s": [_r(x) for x in raw["load_s"]],
            f"{base}_samples_s": [_r(x) for x in raw["get_s"]],
            "bytes_read": raw["load_bytes"][-1],
            f"{base}_bytes": raw["put_bytes"],
            "baseline": baseline,
        },
    )


def gcs_metrics(raw: dict[str, Any]) -> list[Metric]:
    """gcs_save_vs_pipe and gcs_load_vs_cat: against gcsfs ``pipe``/``cat``."""
    where = "one object per rank, 2 ranks in parallel, fake-gcs-server"
    save = store_save_metric("gcs_save_vs_pipe", raw, "pipe", f"gcsfs pipe of {where}")
    return [save, store_load_metric("gcs_load_vs_cat", raw, "cat", f"gcsfs cat of {where}")]


def scale_metrics(raw: dict[str, Any]) -> list[Metric]:
    """plan_scale_vs_dcp, plan_scale_rank_exp and plan_bytes_per_rank (:mod:`bench.scale`)."""
    points = raw["points"]
    tensors = raw["tensors"]
    table = [
        {"ranks": p["ranks"], "ours_s": _r(p["ours_s"]), "dcp_s": _r(p.get("dcp_s", math.nan)),
         "ours_bytes_per_rank": p["ours_bytes_per_rank"],
         "dcp_bytes_per_rank": p["dcp_bytes_per_rank"]}
        for p in points
    ]  # fmt: skip
    with_dcp = [p for p in points if p.get("dcp_s")]
    out = []
    if with_dcp:
        at = max(with_dcp, key=lambda p: p["ranks"])
        out.append(
            Metric(
                name="plan_scale_vs_dcp",
                value=at["ours_s"] / at["dcp_s"],
                detail={"at": f"{at['ranks']} ranks x {tensors} tensors", "points": table},
            )
        )
    else:
        out.append(missing("plan_scale_vs_dcp", "no point where DCP ran"))
    ranks = [float(p["ranks"]) for p in points]
    dcp_exp = growth_exponent([float(p["ranks"]) for p in with_dcp], [p["dcp_s"] for p in with_dcp])
    out.append(
        Metric(
            name="plan_scale_rank_exp",
            value=growth_exponent(ranks, [p["ours_s"] for p in points]),
            detail={"tensors": tensors, "ranks": ranks, "dcp_exp": _r(dcp_exp)},
        )
    )
    last = points[-1]
    out.append(
        Metric(
            name="plan_bytes_per_rank",
            value=last["ours_bytes_per_rank"] / last["dcp_bytes_per_rank"],
            detail={
                "tensors": tensors,
                "ours_bytes": last["ours_bytes_per_rank"],
                "dcp_bytes": last["dcp_bytes_per_rank"],
                "value_is": "bytes a rank sends per save of a layout planned before, ours / DCP",
            },
        )
    )
    return out


def replicated_metrics(raw: dict[str, Any]) -> list[Metric]:
    """read_amplification and read_once_load_vs_each (:mod:`bench.replicated`); round 0 is
    a warm-up."""
    size = raw["checkpoint_bytes"]
    once, each = raw["once_s"][1:], raw["each_s"][1:]
    amplification = _median([b / size for b in raw["once_bytes"][1:]])
    where = f"{raw['ranks']} ranks holding the same state (DDP), SeaweedFS"
    detail = {
        "checkpoint_bytes": size,
        "read_once_bytes": raw["once_bytes"][1:],
        "read_by_each_bytes": raw["each_bytes"][1:],
        "read_by_each_amplification": _r(_median([b / size for b in raw["each_bytes"][1:]])),
        "once_samples_s": [_r(x) for x in once],
        "each_samples_s": [_r(x) for x in each],
        "setting": where,
    }
    ratio = _median(once) / _median(each) if once and each else math.nan
    return [
        Metric(name="read_amplification", value=amplification, detail=detail),
        Metric(
            name="read_once_load_vs_each",
            value=ratio,
            detail={
                "once_median_s": _r(_median(once)),
                "each_median_s": _r(_median(each)),
                "setting": where,
            },
        ),
    ]


def s3_metrics(raw: dict[str, Any]) -> list[Metric]:
    """s3_save_vs_put and s3_load_vs_get: against botocore ``PutObject``/``GetObject``."""
    where = "one object per rank, 2 ranks in parallel, SeaweedFS"
    put = f"botocore PutObject (client defaults) of {where}"
    get = f"botocore GetObject of {where}"
    save = store_save_metric("s3_save_vs_put", raw, "put", put)
    return [save, store_load_metric("s3_load_vs_get", raw, "get", get)]


_RESTART_KEYS = ("restart_to_first_step_s", "detect_s", "rdzv_spawn_import_pg_s", "build_s",
                 "load_s", "up_to_load_s", "start_event_to_first_row_s", "first_step_s")  # fmt: skip


def _restart_breakdown(samples: list[dict[str, float]]) -> dict[str, float]:
    return {f"median_{k}": _r(_median([s[k] for s in samples if k in s])) for k in _RESTART_KEYS}


def restart_metric(
    samples: list[dict[str, float]],
    cold_s: list[float],
    *,
    plain_launcher: list[dict[str, float]] | str | None = None,
    c10d: list[dict[str, float]] | str | None = None,
    **extra: Any,
) -> Metric:
    """restart_overhead: median (last row before a kill -> first row after, minus the load)
    over the restarts of ``samples`` / the median cold ``import torch`` + gloo init.

    ``plain_launcher``: the restarts of a job through the trainer itself when ``samples``
    came through the warm launcher; ``c10d``: the restarts of a job on torchrun's c10d
    rendezvous when ``samples`` ran on ours. Each one's ratio against the same cold
    inits goes into ``detail.<name>`` (and ``detail.<name>_value``), or why there is
    none (a string).
    """
    overhead = _median([s["overhead_s"] for s in samples])
    cold = _median(cold_s)
    detail: dict[str, Any] = {
        "ours_median_s": _r(overhead),
        "cold_init_median_s": _r(cold),
        "cold_init_samples_s": [_r(x) for x in cold_s],
        **_restart_breakdown(samples),
        "restarts": [
            {k: _r(v) if isinstance(v, float) else v for k, v in s.items()} for s in samples
        ],
        **extra,
    }
    for name, side in (("plain_launcher", plain_launcher), ("c10d", c10d)):
        if isinstance(side, str):
            detail[name] = side
        elif side is not None:
            median = _median([s["overhead_s"] for s in side])
            detail[f"{name}_value"] = _r(median / cold)
            detail[name] = {
                "value": _r(median / cold),
                "ours_median_s": _r(median),
                **_restart_breakdown(side),
                "restarts": [
                    {k: _r(v) if isinstance(v, float) else v for k, v in s.items()} for s in side
                ],
            }
    return Metric(name="restart_overhead", value=overhead / cold, detail=detail)


def silent_node_metric(samples: list[dict[str, float]], **extra: Any) -> Metric:
    """Seconds from a node freeze to the first step at the smaller world size (median)."""
    keys = ("detect_s", "rendezvous_s", "restart_s", "load_s", "first_step_s")
    breakdown = {f"median_{k}": _r(_median([s[k] for s in samples])) for k in keys}
    return Metric(
        name="silent_node_loss",
        value=_median([s["silent_node_loss_s"] for s in samples]),
        detail={
            **breakdown,
            "samples": [
                {k: _r(v) if isinstance(v, float) else v for k, v in s.items()} for s in samples
            ],
            **extra,
        },
    )


def ettr_metric(runs: list[dict[str, Any]], **extra: Any) -> Metric:
    return Metric(
        name="ettr",
        value=_median([r["goodput"] for r in runs]),
        detail={"runs": runs, **extra},
    )


def _rounded(obj: Any) -> Any:
    """Floats rounded for the JSON detail, through dicts and lists."""
    if isinstance(obj, float):
        return _r(obj)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


def fault_cost_metric(ours: dict[str, Any], base: dict[str, Any], **extra: Any) -> Metric:
    """fault_cost_s: seconds lost per injected kill with the memory tier on (absolute),
    the durable-only job's figure beside it.

    ``ours`` / ``base``: :func:`bench.fault_cost.fault_cost` of the memory-tier job and of
    the same job without the memory tier.
    """
    from bench.fault_cost import phase_medians

    def side(cost: dict[str, Any]) -> dict[str, Any]:
        keys = ("kills", "downtime_s", "rerun_time_s", "rerun_steps", "goodput",
                "wall_time_s", "mean_s_between_faults", "step_time_median_s")  # fmt: skip
        return {
            "fault_cost_s": _r(cost["fault_cost_s"]),
            "fault_cost_with_first_step_s": _r(cost["fault_cost_with_first_step_s"]),
            "first_step_excess_s": _r(cost["first_step_excess_s"]),
            **{k: _rounded(cost[k]) for k in keys},
            "median_per_kill_s": _rounded(phase_medians(cost["per_kill"])),
            "per_kill": _rounded(cost["per_kill"]),
        }

    value, baseline = ours["fault_cost_s"], base["fault_cost_s"]
    return Metric(
        name="fault_cost_s",
        value=value,
        detail={
            "ours_fault_cost_s": _r(value),
            "baseline_fault_cost_s": _r(baseline),
            "vs_baseline": _r(value / baseline) if baseline else math.nan,
            "value_is": "(downtime + re-run step time) / kills, trainer.report.summarize totals "
            "of the memory-tier job; baseline: the same job, durable tier only",
            "ours_with_first_step_s": _r(ours["fault_cost_with_first_step_s"]),
            "baseline_with_first_step_s": _r(base["fault_cost_with_first_step_s"]),
            "with_first_step_is": "(downtime + re-run step time + each first step's time "
            "above the job's median step) / kills",
            "memory_tier": side(ours),
            "durable_only": side(base),
            **extra,
        },
    )


def loader_metrics(job: dict[str, Any], **extra: Any) -> list[Metric]:
    """loader_fault_cost_s and loader_survivor_exit_s of the loader-worker job
    (:func:`bench.fault_cost.loader_fault_cost_run`): seconds lost per kill, as
    ``fault_cost_s`` counts them, and the slowest survivor's exit after torchrun's SIGTERM
    (the largest over the kills; each one in detail)."""
    from bench.fault_cost import phase_medians

    cost = job["cost"]
    exits = [float(x) for x in job["survivor_exit_s"]]
    common = {
        "num_workers": job["num_workers"],
        "launcher": job["launcher"],
        "rdzv_backend": job["rdzv_backend"],
        "job_wall_s": _r(job["job_wall_s"]),
        **extra,
    }
    return [
        Metric(
            name="loader_fault_cost_s",
            value=cost["fault_cost_s"],
            detail={
                "value_is": "(downtime + re-run step time) / kills of the loader-worker job, "
                "trainer.report.summarize totals",
                "fault_cost_with_first_step_s": _r(cost["fault_cost_with_first_step_s"]),
                "kills": cost["kills"],
                "downtime_s": _r(cost["downtime_s"]),
                "rerun_time_s": _r(cost["rerun_time_s"]),
                "rerun_steps": cost["rerun_steps"],
                "step_time_median_s": _r(cost["step_time_median_s"]),
                "median_per_kill_s": _rounded(phase_medians(cost["per_kill"])),
                "per_kill": _rounded(cost["per_kill"]),
                **common,
            },
        ),
        Metric(
            name="loader_survivor_exit_s",
            value=max(exits) if exits else math.nan,
            detail={
                "value_is": "the largest, over the kills, of torchrun's SIGTERM to the "
                "surviving worker -> its report that the group exited (kills after which "
                "the survivor had already left on its own are not in it: torchrun then "
                "signals nobody)",
                "each_s": [_r(x) for x in exits],
                **common,
            },
        ),
    ]


def memory_metrics(raw: dict[str, dict[str, Any]]) -> list[Metric]:
    """The results of :func:`bench.memory_tier.measure` (``{name: {value, target, ok,
    detail}}``) as metrics; targets and directions come from :data:`TARGETS`."""
    return [
        Metric(name=name, value=float(r["value"]), detail=dict(r["detail"]))
        for name, r in raw.items()
    ]


def rendezvous_metric(rows: list[dict[str, Any]]) -> Metric:
    """rendezvous_vs_c10d: the ``ft`` backend's round (``first_round_s``: all N agents join
    a new rendezvous) over c10d's, at the largest N where ft finished it and c10d either
    finished it or timed out in it (bench/rendezvous.py). A c10d round that did not finish
    counts as its timeout, a lower bound: the value is then an upper bound
    (``detail.c10d_timed_out``). Every phase's ratio at every N, and every row, in detail;
    no such N gives NaN."""
    phase = "first_round_s"
    by = {(r["backend"], r["n"]): r for r in rows}
    detail: dict[str, Any] = {"phase": phase}
    detail["rows"] = [
        {k: (_r(v) if isinstance(v, float) else v) for k, v in r.items()} for r in rows
    ]
    failed = [f"{r['backend']} N={r['n']}: {r['error']}" for r in rows if "error" in r]
    if failed:
        detail["not_measured"] = failed
    ratios: dict[str, dict[str, float]] = {}
    for n in sorted({r["n"] for r in rows}):
        ft, c10d = by.get(("ft", n), {}), by.get(("c10d", n), {})
        for p in ("first_round_s", "reround_s", "reround_after_death_s"):
            theirs = c10d.get(p, c10d.get(p.replace("_s", "_at_least_s")))
            if p in ft and theirs:
                bound = "" if p in c10d else " (c10d timed out: upper bound)"
                ratios.setdefault(f"N={n}", {})[p + bound] = _r(ft[p] / theirs)
    detail["ratios"] = ratios
    usable = [
        n
        for (backend, n), r in by.items()
        if backend == "ft"
        and phase in r
        and (phase in by.get(("c10d", n), {}) or by.get(("c10d", n), {}).get("timed_out") == phase)
    ]
    if not usable:
        detail["status"] = "no N where both backends ran the round"
        return Metric(name="rendezvous_vs_c10d", value=math.nan, detail=detail)
    n = max(usable)
    ft, c10d = by[("ft", n)], by[("c10d", n)]
    theirs = c10d.get(phase, c10d.get("first_round_at_least_s"))
    detail.update(n=n, ft_s=_r(ft[phase]), c10d_s=_r(theirs))
    detail["largest_n_simulated"] = max(r["n"] for r in rows)
    if phase not in c10d:
        detail["c10d_timed_out"] = True
    return Metric(name="rendezvous_vs_c10d", value=_r(ft[phase] / theirs), detail=detail)


# -- cost curves (bench/curves.py) -----------------------------------------------------------


def growth_exponent(xs: list[float], ys: list[float]) -> float:
    """The k of ``y ~ c * x**k``: the least-squares slope of log(y) on log(x).

    Points whose x or y is not a positive finite number are left out; fewer than two
    distinct x left gives NaN. 1.0 is linear growth, 0 none, 2 quadratic."""
    pts = [
        (math.log(x), math.log(y))
        for x, y in zip(xs, ys, strict=True)
        if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)
        and x > 0 and y > 0
    ]  # fmt: skip
    if len({x for x, _ in pts}) < 2:
        return math.nan
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx


def _line(curves: dict[str, Any], curve: str, series: str) -> dict[str, Any] | None:
    """``curves[curve]["series"][series]``, or None when that curve was not measured."""
    return (curves.get(curve) or {}).get("series", {}).get(series)


def _exponent_metric(
    name: str, curves: dict[str, Any], curve: str, series: str, side: str = "ours"
) -> Metric:
    line = _line(curves, curve, series)
    if line is None:
        return missing(name, _why_curve(curves, curve))
    exps = {k: _r(growth_exponent(line["x"], v)) for k, v in line["lines"].items()}
    return Metric(
        name=name,
        value=exps[side],
        detail={
            "curve": curve,
            "series": series,
            "x": line["x"],
            "unit": line.get("unit"),
            "lines": {
                k: [None if v is None else _r(v) for v in vals] for k, vals in line["lines"].items()
            },
            "exponents": exps,
            "x_is": curves[curve]["x_label"],
            "fit": "least-squares slope of log(y) on log(x), ours (DCP's beside it)",
        },
    )


def _why_curve(curves: dict[str, Any], curve: str) -> str:
    got = curves.get(curve)
    if got is None:
        return f"curve {curve!r} not measured"
    return str(got.get("error", f"curve {curve!r} has no such series"))[:500]


def dcp_ratios(curves: dict[str, Any], names: tuple[str, ...]) -> list[dict[str, Any]]:
    """ours / DCP at every point of every series of ``names`` marked ``vs_dcp`` (the times
    of the operations both run: save, async stall, loads)."""
    out = []
    for curve in names:
        for series, line in (curves.get(curve) or {}).get("series", {}).items():
            lines = line["lines"]
            if "dcp" not in lines or not line.get("vs_dcp"):
                continue
            for x, ours, dcp in zip(line["x"], lines["ours"], lines["dcp"], strict=True):
                if ours is None or dcp is None or not dcp > 0:
                    continue
                out.append({"curve": curve, "series": series, "x": x, "ratio": _r(ours / dcp),
                            "ours_s": _r(ours), "dcp_s": _r(dcp)})  # fmt: skip
    return out


def _max_ratio_metric(name: str, ratios: list[dict[str, Any]], why: str, **extra: Any) -> Metric:
    if not ratios:
        return missing(name, why)
    worst = max(ratios, key=lambda r: r["ratio"])
    return Metric(
        name=name,
        value=worst["ratio"],
        detail={"worst": worst, "points": ratios, **extra},
    )


def _discovery_metric(name: str, curves: dict[str, Any], backend: str) -> Metric:
    """Time at the most checkpoints / at the fewest, for a resume and for discovery alone
    (the larger of the two is the value)."""
    roots = curves.get("checkpoints") or {}
    detail: dict[str, Any] = {"backend": backend}
    ratios = {}
    for op in ("resume", "discovery"):
        line = _line(curves, "checkpoints", op)
        values = (line or {}).get("lines", {}).get(backend)
        if not values or values[0] is None or values[-1] is None:
            continue
        ratios[op] = values[-1] / values[0]
        detail[op] = {"x": line["x"], "s": [_r(v) for v in values], "ratio": _r(ratios[op])}
    calls = roots.get("calls", {}).get(backend)
    if calls:
        detail["storage_calls"] = calls
    if not ratios:
        return missing(name, _why_curve(curves, "checkpoints") if roots else "not measured")
    detail["value_is"] = "max over resume and discovery of time at the most / at the fewest"
    return Metric(name=name, value=_r(max(ratios.values())), detail=detail)


def curve_metrics(curves: dict[str, Any]) -> list[Metric]:
    """The metrics of the ``curves`` group from the series :func:`bench.curves.series` built."""
    out = [
        _exponent_metric("curve_save_bytes_exp", curves, "bytes", "save"),
        _exponent_metric("curve_load_bytes_exp", curves, "bytes", "load (cold)"),
        _exponent_metric("curve_save_tensors_exp", curves, "tensors", "save"),
        _exponent_metric("curve_load_tensors_exp", curves, "tensors", "load (cold)"),
    ]
    ratios = dcp_ratios(curves, ("bytes", "tensors", "ranks"))
    out.append(_max_ratio_metric("curve_vs_dcp", ratios, "curves 1-3 not measured"))
    many = [r for r in ratios if r["curve"] == "tensors" and r["x"] >= 10_000]
    out.append(
        _max_ratio_metric(
            "curve_many_tensors_vs_dcp", many, "no point of 10,000 tensors or more measured"
        )
    )
    out.append(_exponent_metric("curve_rank0_share_exp", curves, "ranks", "rank 0 share"))
    out.append(_discovery_metric("curve_discovery_local", curves, "local"))
    out.append(_discovery_metric("curve_discovery_gcs", curves, "gcs"))
    out.append(_discovery_metric("curve_discovery_s3", curves, "s3"))
    line = _line(curves, "bytes", "save RSS growth / state")
    if line is None:
        out.append(missing("curve_save_memory", _why_curve(curves, "bytes")))
    else:
        ours = [v for v in line["lines"]["ours"] if v is not None]
        out.append(
            Metric(
                name="curve_save_memory",
                value=max(ours) if ours else math.nan,
                detail={
                    "x": line["x"],
                    **{k: v for k, v in line["lines"].items()},
                    "value_is": "max over sizes and ranks of peak RSS growth during a "
                    "save / the rank's state bytes",
                },
            )
        )
    return out
