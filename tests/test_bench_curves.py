"""The ``curves`` bench group: the growth-exponent fit, the series and metrics built from
samples (pure), the roots of many checkpoints, the method probes, and the whole group on
a tiny configuration (real ranks, real files; no timing is asserted)."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest

from bench import curves as cv
from bench import metrics as m
from bench.curve_roots import pruned_step, root_steps
from bench.probe import CollectiveCounter, PhaseTimer
from testing.spawn import run_ok

# -- the fit -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("xs", "ys", "want"),
    [
        ([1, 2, 4, 8], [3, 6, 12, 24], 1.0),  # linear
        ([1, 10, 100], [5, 500, 50_000], 2.0),  # quadratic
        ([10, 100, 1000], [0.2, 0.2, 0.2], 0.0),  # flat
        ([4, 16, 64], [2, 4, 8], 0.5),  # square root
        ([1, 10, 100], [100, 10, 1], -1.0),  # shrinking
        ([64, 256, 1024, 4096], [0.1, 0.4, 1.6, 6.4], 1.0),
        ([1, 2, 4], [1, 0, 4], 1.0),  # a zero is left out (no log of it)
        ([1, 2, 4], [1, None, 4], 1.0),  # so is a missing point
        ([1, 2, 4], [1, float("nan"), 4], 1.0),
        ([2, 4], [1, 2], 1.0),
    ],
)
def test_growth_exponent_is_the_log_log_slope(xs, ys, want):
    assert m.growth_exponent(xs, ys) == pytest.approx(want, abs=1e-9)


def test_growth_exponent_is_the_least_squares_fit_of_noisy_points():
    # log2 y = 0, 1.1, 1.9, 3 at log2 x = 0, 1, 2, 3: slope (0*-1.5 + 1.1*-0.5 + 1.9*0.5 + 3*1.5 - 0) / 5
    got = m.growth_exponent([1, 2, 4, 8], [1, 2**1.1, 2**1.9, 8])
    assert got == pytest.approx((1.1 * -0.5 + 1.9 * 0.5 + 3 * 1.5) / 5)


@pytest.mark.parametrize(
    ("xs", "ys"),
    [([5], [1.0]), ([5, 5], [1.0, 2.0]), ([1, 2], [0, 0]), ([], []), ([1, 2], [None, 3])],
)
def test_growth_exponent_needs_two_distinct_usable_points(xs, ys):
    assert math.isnan(m.growth_exponent(xs, ys))


# -- from samples to series and metrics (pure) ---------------------------------------------


def _point(spec, world, times, *, rss=None, phases=None, collectives=None, **extra):
    per_rank = [1000] * world
    return {
        "spec": spec,
        "world": world,
        "times": times,
        "rank_rss_growth": rss or [{} for _ in range(world)],
        "rank_state_bytes": per_rank,
        "rank_phases": phases or [{"ours": [], "dcp": []}] * world,
        "collectives": collectives or {},
        **extra,
    }


def _phases(total, coordinator):
    row = {"total": total, "local_plan": 0.0, "global_plan": 0.0, "write": total / 2,
           "metadata": 0.0, "coordinator": coordinator}  # fmt: skip
    return {"ours": [row], "dcp": [dict(row, coordinator=0.0)]}


def _raw():
    """Samples shaped as the curves group's ranks return them, with known answers."""
    fsdp = [{"kind": "fsdp", "width": w} for w in (10, 20, 40)]
    bytes_points = [
        _point(
            spec,
            2,
            {
                "save_ours": [s, s, 9],
                "save_dcp": [2 * s] * 3,
                "load_ours": [s],
                "load_dcp": [s],
                "async_ours": [0.01],
                "async_dcp": [0.1],
            },
            rss=[{"save_ours": [100, 400], "load_ours": [1000]}, {"save_ours": [200]}],
            collectives={},
        )
        for spec, s in zip(fsdp, (1.0, 2.0, 4.0), strict=True)
    ]
    for p, scale in zip(bytes_points, (1, 2, 4), strict=True):
        p["rank_state_bytes"] = [1000 * scale, 1000 * scale]
    counted = {side: {"rank0_counts": {"gather_object": 3}, "per_rank": [{"bytes": {"g": 10}}] * 2}
               for side in ("ours", "dcp")}  # fmt: skip
    ranks_points = [
        _point(
            fsdp[0],
            w,
            {"save_ours": [1.0], "save_dcp": [1.0 * w / 2], "load_ours": [1.0], "load_dcp": [1.0]},
            phases=[_phases(1.0, 0.1 * (w / 2) ** 0.5)] * w,
            collectives=counted,
        )
        for w in (2, 4, 8)
    ]
    tensor_points = [
        _point(
            {"kind": "tensors", "count": n, "bytes": 1},
            2,
            {
                "save_ours": [n / 1000],
                "save_dcp": [n / 250],
                "load_ours": [n / 1000],
                "load_dcp": [n / 1000 * (0.8 if n >= 10_000 else 2)],
            },
            phases=[_phases(n / 1000, 0.0)] * 2,
            ours_manifest_bytes=n,
            ours_metadata_bytes=n,
            dcp_metadata_bytes=n,
        )
        for n in (100, 1000, 10_000)
    ]
    ops = {
        base: {n: {op: {"s": [f * (1 + n / 1000)], "calls": {"list": 1}} for op in
                   ("resume", "discovery", "ls", "prune", "gc")} for n in (10, 100, 1000)}
        for base, f in (("local", 0.01), ("gcs", 0.02), ("s3", 0.03))
    }  # fmt: skip
    ops["gcs"][1000]["resume"]["s"] = [0.02 * 3]  # 3x its time at 10: a miss
    return {
        "bytes": {
            "points": bytes_points,
            "reshard": [_point(fsdp[0], 1, {"load_ours": [3.0], "load_dcp": [2.0]})],
            "reshard_worlds": [2, 1],
            "wall_s": 10.0,
        },
        "tensors": {"points": tensor_points},
        "ranks": {"points": ranks_points},
        "checkpoints": {"ops": ops},
        "memory": {"error": "RuntimeError: no /dev/shm"},
    }


def test_series_have_a_line_per_side_with_medians_and_exponents():
    curves = cv.series(_raw())
    save = curves["bytes"]["series"]["save"]
    assert save["x"] == [2000.0, 4000.0, 8000.0]
    assert save["lines"] == {"ours": [1.0, 2.0, 4.0], "dcp": [2.0, 4.0, 8.0]}
    assert save["exponents"]["ours"] == pytest.approx(1.0)
    assert save["vs_dcp"] and save["unit"] == "s"
    reshard = curves["bytes"]["series"]["reshard load 2 -> 1"]
    assert reshard["x"] == [2000.0] and reshard["lines"] == {"ours": [3.0], "dcp": [2.0]}
    growth = curves["bytes"]["series"]["save RSS growth / state"]
    assert growth["lines"]["ours"][0] == pytest.approx(0.4)  # max over ranks and rounds
    assert growth["lines"]["dcp"] == [None, None, None]  # not sampled
    assert not growth["vs_dcp"]
    share = curves["ranks"]["series"]["rank 0 share"]
    assert share["exponents"]["ours"] == pytest.approx(0.5)
    assert share["lines"]["dcp"] == [0.0, 0.0, 0.0]
    assert curves["ranks"]["series"]["collectives in a save (rank 0)"]["lines"]["ours"] == [3.0] * 3
    meta = curves["tensors"]["series"]["manifest + .metadata bytes"]
    assert meta["lines"]["ours"] == [200.0, 2000.0, 20_000.0]
    assert curves["checkpoints"]["series"]["resume"]["lines"]["gcs"][-1] == pytest.approx(0.06)
    assert curves["checkpoints"]["calls"]["local"]["ls"][10] == {"list": 1}
    assert curves["memory"] == {"title": cv.TITLES["memory"], "error": "RuntimeError: no /dev/shm"}


def test_curve_metrics_are_the_group_and_say_what_they_measured():
    got = {x.name: x for x in m.curve_metrics(cv.series(_raw()))}
    assert list(got) == list(m.GROUPS["curves"])
    assert got["curve_save_bytes_exp"].value == pytest.approx(1.0)
    assert got["curve_save_bytes_exp"].ok  # 1.0 <= 1.05
    assert got["curve_save_tensors_exp"].value == pytest.approx(1.0)
    # the worst ours / DCP over curves 1-3: the reshard load 2 -> 1 (3.0 / 2.0)
    worst = got["curve_vs_dcp"].detail["worst"]
    assert got["curve_vs_dcp"].value == pytest.approx(1.5) and not got["curve_vs_dcp"].ok
    assert (worst["curve"], worst["series"]) == ("bytes", "reshard load 2 -> 1")
    # at 10k tensors: save 0.25, load 1 / 0.8 = 1.25
    assert got["curve_many_tensors_vs_dcp"].value == pytest.approx(1.25)
    assert {p["x"] for p in got["curve_many_tensors_vs_dcp"].detail["points"]} == {10_000}
    assert got["curve_rank0_share_exp"].value == pytest.approx(0.5)
    assert not got["curve_rank0_share_exp"].ok
    assert got["curve_discovery_local"].value == pytest.approx(2.0 / 1.01, rel=1e-3)
    assert got["curve_discovery_gcs"].value == pytest.approx(0.06 / 0.0202, rel=1e-3)
    assert not got["curve_discovery_gcs"].ok
    assert got["curve_discovery_s3"].value == pytest.approx(2.0 / 1.01, rel=1e-3)
    assert got["curve_discovery_s3"].detail["backend"] == "s3"
    assert got["curve_save_memory"].value == pytest.approx(0.4)


def test_a_curve_that_failed_makes_its_metrics_nan_with_the_reason():
    raw = _raw()
    raw["bytes"] = {"error": "RankFailedError: rank 1 died"}
    got = {x.name: x for x in m.curve_metrics(cv.series(raw))}
    for name in ("curve_save_bytes_exp", "curve_load_bytes_exp", "curve_save_memory"):
        assert math.isnan(got[name].value) and "rank 1 died" in got[name].detail["status"]
    assert not math.isnan(got["curve_save_tensors_exp"].value)


# -- roots of many checkpoints ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "steps", "pruned"),
    [
        (5, [10, 11, 12, 13, 14], 11),
        (6, [10, 20, 21, 22, 23, 24], 21),
        (10, [10, 20, 30, 40, 50, 60, 61, 62, 63, 64], 61),
    ],
)
def test_a_root_of_n_checkpoints_loses_exactly_one_to_the_prune(n, steps, pruned):
    from bench.curve_roots import prune_policy
    from ckpt.root.retention import plan_retention

    assert root_steps(n) == steps and pruned_step(n) == pruned
    plan = plan_retention(steps, [], prune_policy())
    assert plan.delete == (pruned,)
    with pytest.raises(ValueError, match="at least 5"):
        root_steps(4)


# -- probes ----------------------------------------------------------------------------------


class _Base:
    def work(self, n):
        return n


class _Child(_Base):
    def work(self, n):
        import time

        time.sleep(0.01)
        return super().work(n) + 1


def test_phase_timer_counts_the_outermost_call_once_and_puts_the_methods_back():
    before = (vars(_Child)["work"], vars(_Base)["work"])
    with PhaseTimer({"work": [(_Base, "work"), (_Child, "work")], "none": [(_Base, "work")]}) as t:
        assert _Child().work(1) == 2
        assert _Base().work(5) == 5
    assert t.calls["work"] == 2  # the child's call and the base's own, not super() again
    assert t.seconds["work"] >= 0.01
    assert (vars(_Child)["work"], vars(_Base)["work"]) == before


def _count_on_ranks(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    with CollectiveCounter() as counter:
        out = [None] * world
        dist.all_gather_object(out, {"rank": rank, "pad": "x" * 100})
        dist.all_reduce(torch.ones(8))
        dist.barrier()
    dist.all_gather_object([None] * world, "after the block: not counted")
    return {"counts": counter.counts, "bytes": counter.bytes}


@pytest.mark.timeout(120)
def test_collective_counter_counts_outermost_collectives_and_their_payloads():
    got = run_ok(_count_on_ranks, 2, timeout_s=90)
    for rank in got:
        # all_gather_object runs all_gather inside: counted once
        assert rank["counts"] == {"all_gather_object": 1, "all_reduce": 1, "barrier": 1}
        assert rank["bytes"]["all_reduce"] == 32 and rank["bytes"]["barrier"] == 0
        assert rank["bytes"]["all_gather_object"] > 100


# -- the whole group, tiny -------------------------------------------------------------------

TINY = dataclasses.replace(
    cv.QUICK,
    bytes_sizes=(2 << 20, 8 << 20),
    bytes_rounds=(1, 1),
    async_max_bytes=8 << 20,
    tensor_counts=(20, 60),
    tensor_bytes=1 << 20,
    tensor_rounds=(1, 1),
    ranks=(2,),
    ranks_bytes=2 << 20,
    root_counts=(5, 8),
    root_rounds=1,
    snapshot_sizes=(),
    timeout_s=240,
)


@pytest.mark.timeout(600)
def test_the_group_on_a_tiny_configuration_writes_plots_json_and_every_metric(tmp_path):
    work, plots = tmp_path / "work", tmp_path / "plots"
    work.mkdir()
    lines = []
    metrics = cv.run(str(work), TINY, str(plots), lines.append)
    by_name = {x.name: x for x in metrics}
    assert list(by_name) == list(m.GROUPS["curves"])
    for name in ("curve_save_bytes_exp", "curve_load_bytes_exp", "curve_save_tensors_exp",
                 "curve_load_tensors_exp", "curve_vs_dcp", "curve_discovery_local",
                 "curve_discovery_gcs", "curve_discovery_s3", "curve_save_memory"):  # fmt: skip
        assert math.isfinite(by_name[name].value), (name, by_name[name].detail)
    assert "10,000" in by_name["curve_many_tensors_vs_dcp"].detail["status"]
    assert "status" in by_name["curve_rank0_share_exp"].detail or math.isnan(
        by_name["curve_rank0_share_exp"].value
    )  # one world size: no slope
    saved = json.loads((plots / "curves.json").read_text())
    assert saved["mode"]["bytes_sizes"] == [2 << 20, 8 << 20]
    curves = saved["curves"]
    assert set(curves) == set(cv.CURVES)
    bytes_series = curves["bytes"]["series"]
    assert set(bytes_series) >= {"save", "async stall", "load (cold)", "reshard load 2 -> 1"}
    for line in bytes_series.values():
        for side, values in line["lines"].items():
            fitted = m.growth_exponent(line["x"], values)
            assert line["exponents"][side] == pytest.approx(fitted, nan_ok=True)
    assert curves["checkpoints"]["series"]["resume"]["x"] == [5.0, 8.0]
    assert set(curves["checkpoints"]["series"]["resume"]["lines"]) == {"local", "gcs", "s3"}
    assert curves["memory"]["series"] == {}  # nothing asked of curve 5
    for name in ("bytes", "tensors", "ranks", "checkpoints"):
        png = (plots / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 100_000, name
    assert not (plots / "memory.png").exists()
    assert any("curves: bytes done" in line for line in lines)
    assert os.listdir(work) == []  # every curve cleaned up after itself
