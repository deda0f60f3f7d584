"""The benchmark harness: imports, --help, the table of targets, --only, the metric math.

Pure functions only (no ranks are spawned, no timing is asserted).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import itertools
import json
import math
import os
import pkgutil
import re
import statistics
import subprocess
import sys

import pytest

import bench
from bench import metrics as m
from bench.__main__ import QUICK, _parse, parse_only, tasks, why_missing
from bench.report import markdown_table, write_json
from bench.rounds import _leaves

SPEC = [
    ("save_vs_dcp", 1.0, "<="),
    ("save_vs_disk", 0.80, ">="),
    ("load_vs_disk", 0.75, ">="),
    ("reshard_load", 1.2, "<="),
    ("save_memory", 0.5, "<="),
    ("trainer_overhead", 0.98, ">="),
    ("async_stall", 0.05, "<="),
    ("persist_interference", 1.10, "<="),
    ("async_staging_growth", 0.05, "<="),
    ("memory_tier_stall", 0.02, "<="),
    ("peer_restore_vs_disk", 0.5, "<="),
    ("restart_overhead", 1.2, "<="),
    ("fault_cost_s", 2.0, "<="),
    ("ettr", 0.92, ">="),
    ("silent_node_loss", 2.0, "<="),
    ("loader_fault_cost_s", 1.5, "<="),
    ("loader_survivor_exit_s", 0.5, "<="),
    ("rendezvous_vs_c10d", 0.33, "<="),
    ("loader_resume_exact", 1.0, ">="),
    ("loader_seed_overhead", 1.2, "<="),
    ("export_memory", 2.0, "<="),
    ("export_vs_read", 0.8, ">="),
    ("gcs_load_vs_cat", 1.3, ">="),
    ("gcs_save_vs_pipe", 1.3, ">="),
    ("s3_save_vs_put", 1.3, ">="),
    ("s3_load_vs_get", 1.3, ">="),
    ("curve_save_bytes_exp", 1.05, "<="),
    ("curve_load_bytes_exp", 1.05, "<="),
    ("curve_save_tensors_exp", 1.05, "<="),
    ("curve_load_tensors_exp", 1.05, "<="),
    ("curve_vs_dcp", 1.0, "<="),
    ("curve_many_tensors_vs_dcp", 0.5, "<="),
    ("curve_rank0_share_exp", 0.2, "<="),
    ("curve_discovery_local", 2.0, "<="),
    ("curve_discovery_gcs", 2.0, "<="),
    ("curve_discovery_s3", 2.0, "<="),
    ("curve_save_memory", 0.5, "<="),
    ("read_amplification", 1.05, "<="),
    ("read_once_load_vs_each", 1.0, "<="),
    ("plan_scale_vs_dcp", 0.1, "<="),
    ("plan_scale_rank_exp", 1.05, "<="),
    ("plan_bytes_per_rank", 0.1, "<="),
]


@pytest.mark.timeout(120)
def test_every_bench_module_imports_and_help_works():
    for module in pkgutil.iter_modules(bench.__path__):
        if module.name != "__main__":
            importlib.import_module(f"bench.{module.name}")
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    for option in ("--quick", "--json", "--only", "--dir"):
        assert option in result.stdout
    for group in m.GROUPS:
        assert group in result.stdout


def test_targets_table_is_the_issue_table_in_its_order():
    assert [(name, target, d) for name, (target, d) in m.TARGETS.items()] == SPEC


def test_groups_split_the_table_exactly_once():
    assert list(m.GROUPS) == [
        "save", "load", "async", "overhead", "gcs", "s3", "memory", "elastic", "rendezvous",
        "loader", "export", "curves", "replicated", "scale",
    ]  # fmt: skip
    grouped = [name for names in m.GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(m.TARGETS)
    assert m.GROUPS["load"] == ("load_vs_disk", "reshard_load")
    assert m.GROUPS["memory"] == ("memory_tier_stall", "peer_restore_vs_disk")
    assert m.GROUPS["elastic"] == (
        "restart_overhead", "fault_cost_s", "ettr", "silent_node_loss",
        "loader_fault_cost_s", "loader_survivor_exit_s",
    )  # fmt: skip


@pytest.mark.parametrize(("name", "target", "direction"), SPEC)
def test_metric_takes_target_and_direction_from_the_table(name, target, direction):
    metric = m.Metric(name=name, value=target)
    assert (metric.target, metric.direction) == (target, direction)
    assert metric.ok  # on the target passes either way
    worse = target * 1.5 if direction == "<=" else target * 0.5
    better = target * 0.5 if direction == "<=" else target * 1.5
    assert not m.Metric(name=name, value=worse).ok
    assert m.Metric(name=name, value=better).ok
    assert not m.Metric(name=name, value=math.nan).ok


def test_staging_growth_is_the_rank_that_grew_most_over_its_first_save():
    raw = {"rss_mib": [[500.0, 510.0, 505.0], [400.0, 420.0, 440.0]], "state_bytes": 1 << 20}
    metric = m.staging_growth_metric(raw)
    assert metric.value == pytest.approx(0.10)
    assert not metric.ok
    assert metric.detail["saves"] == 3 and metric.detail["rss_peak_mib"] == [510.0, 440.0]
    steady = m.staging_growth_metric({"rss_mib": [[500.0, 501.0]], "state_bytes": 1})
    assert steady.ok


def test_unknown_metric_name_is_refused():
    with pytest.raises(KeyError, match="reshard_loads"):
        m.Metric(name="reshard_loads", value=1.0)
    with pytest.raises(KeyError):
        m.missing("nope", "why")


def test_missing_is_nan_never_ok_and_says_why():
    metric = m.missing("ettr", "full mode only")
    assert math.isnan(metric.value) and not metric.ok
    assert metric.to_json() == {
        "value": metric.value,
        "target": 0.92,
        "ok": False,
        "detail": {"status": "full mode only"},
    }


def test_complete_orders_by_table_and_fills_the_rest():
    last = list(m.TARGETS)[-1]
    produced = [
        m.Metric(name=last, value=0.9, detail={"x": 1}),
        m.Metric(name="save_vs_dcp", value=1.3),
        m.Metric(name="save_vs_dcp", value=0.1),  # a second one is ignored
    ]
    out = m.complete(produced, lambda name: f"why {name}")
    assert [x.name for x in out] == list(m.TARGETS)
    assert out[0].value == 1.3
    assert out[-1].detail == {"x": 1}
    for metric in out[1:-1]:
        assert math.isnan(metric.value)
        assert metric.detail == {"status": f"why {metric.name}"}


def test_parse_only_returns_groups_in_run_order():
    assert parse_only("load,save") == ("save", "load")
    assert parse_only(" elastic , gcs,gcs") == ("gcs", "elastic")
    assert parse_only("overhead") == ("overhead",)


@pytest.mark.parametrize("text", ["bogus", "save,bogus", "", "save,", "Save"])
def test_parse_only_rejects_unknown_groups_naming_the_valid_ones(text):
    with pytest.raises(argparse.ArgumentTypeError, match="valid groups: save, load, async"):
        parse_only(text)


def test_only_option_default_and_error(capsys):
    assert _parse([]).only == tuple(m.GROUPS)
    assert _parse(["--quick", "--only", "load,save"]).only == ("save", "load")
    with pytest.raises(SystemExit) as exc:
        _parse(["--only", "save,reshard"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--only" in err and "'reshard'" in err
    assert "save, load, async, overhead, gcs, s3, memory, elastic" in err


def test_curves_subcommand_is_only_curves_with_the_other_options_kept():
    args = _parse(["curves", "--quick", "--plot", "out", "--json", "x.json"])
    assert args.only == ("curves",) and args.quick and args.plot == "out"
    assert args.json == "x.json"
    assert _parse(["--only", "curves"]).plot is None
    with pytest.raises(SystemExit):
        _parse(["curve"])  # a typo is not a group


def test_why_missing():
    selected = ("save", "load")
    errors = {"save": [], "load": ["reshard rounds: rank 1 died"]}
    assert why_missing("ettr", selected, errors) == "not run (--only)"
    assert why_missing("async_stall", selected, errors) == "not run (--only)"
    assert why_missing("reshard_load", selected, errors) == "failed: reshard rounds: rank 1 died"
    assert why_missing("save_memory", selected, errors) == "not measured (see stderr)"
    long = {"load": ["x" * 2000]}
    assert len(why_missing("load_vs_disk", ("load",), long)) == 500


def test_tasks_cover_every_group_in_order(tmp_path):
    got = tasks(str(tmp_path), QUICK)
    groups = list(dict.fromkeys(group for group, _what, _run in got))
    assert groups == list(m.GROUPS)
    assert list(tmp_path.iterdir()) == []  # building the list runs nothing


def test_json_has_every_metric_in_the_same_shape(tmp_path):
    results = m.complete([m.Metric(name="save_memory", value=0.1)], lambda _: "not run (--only)")
    out = tmp_path / "bench.json"
    write_json(str(out), results, {"mode": "quick"})
    obj = json.loads(out.read_text())
    assert sorted(obj) == sorted(m.TARGETS)
    for name, entry in obj.items():
        assert set(entry) == {"value", "target", "ok", "detail"}
        assert entry["target"] == m.TARGETS[name][0]
        assert entry["detail"]["run"] == {"mode": "quick"}
    assert obj["save_memory"]["ok"] is True
    assert obj["ettr"]["detail"]["status"] == "not run (--only)"
    table = markdown_table(results).splitlines()
    assert len(table) == 2 + len(m.TARGETS)
    assert table[2].startswith("| save_vs_dcp | NaN | <= 1 | no |")


def _load(world: int, load_s: float) -> dict:
    return {"world": world, "load_s": load_s, "bytes_read": 100, "cache_drop": "drop_caches"}


def test_reshard_metric_is_fewer_ranks_over_same_world():
    saved = {"world": 4, "checkpoint_bytes": 400, "digest": {}}
    loads = [_load(4, 1.0), _load(2, 3.0), _load(2, 1.5), _load(4, 2.0), _load(4, 1.5)]
    loads.append(_load(2, 2.1))
    metric = m.reshard_metric(saved, loads)
    assert metric.name == "reshard_load"
    assert metric.value == pytest.approx(2.1 / 1.5)
    assert not metric.ok
    d = metric.detail
    assert d["reshard"] == "4 -> 2 ranks" and d["same_world"] == "4 -> 4 ranks"
    assert d["reshard_samples_s"] == [3.0, 1.5, 2.1]
    assert d["same_world_samples_s"] == [1.0, 2.0, 1.5]
    assert d["checkpoint_bytes"] == 400
    assert d["cache_drop"] == ["drop_caches"]
    with pytest.raises(ValueError, match="one resharding world size"):
        m.reshard_metric(saved, [*loads, _load(1, 1.0)])


def test_load_metric_is_our_rate_over_dd_rate():
    raw = {
        "times": {"cold_ours": [2.0, 1.0, 3.0], "cold_dd": [1.0, 1.0, 1.0]},
        "total_bytes": 1000,
        "shard_bytes": 900,
        "ours_bytes_read": [990],
        "cache_drop": ["drop_caches"],
        "world": 2,
    }
    metric = m.load_metric(raw)
    assert metric.name == "load_vs_disk"
    assert metric.value == pytest.approx((1000 / 2.0) / (900 / 1.0))
    assert metric.detail["ranks"] == 2


def test_leaves_walks_nested_state_in_order():
    state = {"model": {"a": 1, "b": [2, {"c": 3}]}, "step": 4}
    assert _leaves(state) == [("model.a", 1), ("model.b[0]", 2), ("model.b[1].c", 3), ("step", 4)]


# -- the memory group and the kill jobs (fault_cost_s, ettr, restart_overhead) ------------


def test_help_says_which_metrics_are_full_mode_only_and_which_launcher_runs():
    from bench.__main__ import FULL_ONLY

    result = subprocess.run(
        [sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, timeout=60
    )
    text = " ".join(result.stdout.split())
    start = text.index("--quick", text.index("options:"))
    quick = text[start : text.index("--only GROUP", start)]
    for name in FULL_ONLY:
        assert name in quick
    assert "(full mode only)" in quick
    assert "memory_tier_stall" not in quick  # the memory group runs in quick mode too
    assert "-m warmstart -m trainer" in text


def test_full_only_is_what_quick_mode_skips(tmp_path):
    from bench.__main__ import FULL, FULL_ONLY, _elastic, _loader, _silent

    skipped = _elastic(str(tmp_path), QUICK) + _silent(str(tmp_path), QUICK)
    skipped += _loader(str(tmp_path), QUICK)
    assert tuple(x.name for x in skipped) == FULL_ONLY
    for metric in skipped:
        assert math.isnan(metric.value)
        assert metric.detail["status"].startswith("full mode only")
    assert list(tmp_path.iterdir()) == []
    assert FULL.elastic_jobs and FULL.silent_runs > 0


@pytest.mark.parametrize("short_jobs", ["ran", "failed"])
def test_the_kill_jobs_are_sized_from_the_shorter_jobs_step_time(tmp_path, monkeypatch, short_jobs):
    import bench.__main__ as b
    from bench.fault_cost import KillPlan

    class Stop(Exception):
        pass

    def short(work, max_steps, *args, **kwargs):
        assert max_steps == b.PLAIN_MAX_STEPS  # the shorter jobs run before the kill jobs
        if short_jobs == "failed":
            raise RuntimeError("no job")
        times = [0.13] * 20 + [0.05] * 9  # median 0.13
        return {"metrics": [{"step_time_s": t} for t in times], "events": [], "logs": []}

    plans = []

    def kill_job(work, plan, *args, **kwargs):
        plans.append(plan)
        raise Stop

    monkeypatch.setattr(b, "warm_available", lambda: True)
    monkeypatch.setattr(b, "cold_init_s", lambda work: 1.0)
    monkeypatch.setattr(b, "elastic_run", short)
    monkeypatch.setattr(b, "restarts", lambda *args: [])
    monkeypatch.setattr(b, "fault_cost_run", kill_job)
    with pytest.raises(Stop):
        b._elastic(str(tmp_path), b.FULL)
    expected = KillPlan.sized(0.13) if short_jobs == "ran" else b.KILL_PLAN
    assert plans == [expected]
    assert (plans[0] == b.KILL_PLAN) == (short_jobs == "failed")


def test_memory_group_uses_the_memory_tier_modes_of_ours():
    from bench import memory_tier
    from bench.__main__ import FULL

    assert QUICK.memory is memory_tier.QUICK
    assert FULL.memory is memory_tier.FULL
    assert set(m.GROUPS["memory"]) <= set(memory_tier.TARGETS)


def test_every_memory_restore_starts_from_the_files_a_save_left(tmp_path, monkeypatch):
    """Before each memory restore of peer_restore_vs_disk every node's memory files are
    new copies (the disk side's cache drops mark tmpfs pages for reclaim, which slows a
    later map of them); node 1's are gone for the peer restore only; one more peer
    restore after a drop goes to the detail, not into the value."""
    from bench import memory_tier as mt

    drops: list[int] = []
    seen: list[dict] = []

    def fake_run(fn, ranks, *args, timeout_s):
        memory = args[1]
        if fn is mt.restore_save:
            for r in range(ranks):
                os.makedirs(mt._node(memory, r))
                with open(os.path.join(mt._node(memory, r), "shard"), "w") as f:
                    f.write(f"node {r}")
            return [{"digest": "d", "bytes": 100}] * ranks
        tier = args[3]
        node0 = os.path.join(mt._node(memory, 0), "shard")
        with open(node0) as f:
            fresh = f.read() == "node 0"
        with open(node0, "a") as f:  # a later restore sees this unless the file is copied anew
            f.write(" used")
        seen.append({
            "tier": tier, "peer": len(args) > 4 and args[4],
            "node1": os.path.isdir(mt._node(memory, 1)), "fresh": fresh, "drops": len(drops),
        })  # fmt: skip
        s = {"memory": 0.2, "disk_cold": 0.4}.get(tier, 0.3)
        if tier == "memory" and len(seen) > 1 and seen[-1]["drops"] > seen[-2]["drops"]:
            s = 0.9  # a restore right after a drop: must not count
        out = {"s": s, "digest": "d", "phases": {}, "transfer": None,
               "cache_drop": "drop_caches" if tier == "disk_cold" else None}  # fmt: skip
        if tier == "disk_cold":
            drops.append(1)
        return [out] * ranks

    monkeypatch.setattr(mt, "run_on_ranks", fake_run)
    monkeypatch.setattr(mt.disk, "drop_page_cache", lambda paths: drops.append(1) or "drop_caches")
    mode = mt.Mode("t", 1, 1, 1 << 20, restore_rounds=3, timeout_s=60)
    raw = mt.restore_rounds(str(tmp_path), str(tmp_path / "memory"), mode, None)
    memory_samples = [x for x in seen if x["tier"] == "memory"]
    assert len(memory_samples) == 3 * 2 + 1
    assert all(x["fresh"] for x in seen)  # a new copy of node 0's files every time
    for x in memory_samples[:-1]:
        assert x["node1"] is not x["peer"]  # node 1 lost for the peer restore only
    last = memory_samples[-1]
    assert last is seen[-1] and not last["node1"] and last["drops"] > seen[-2]["drops"]
    assert raw["times"][mt.AFTER_DROP] == [0.9]
    metric = mt.restore_metric(raw, mode)
    assert metric["value"] == pytest.approx(0.2 / 0.4)
    assert metric["detail"]["peer_after_drop_s"] == pytest.approx(0.9)


def test_memory_metrics_take_target_and_direction_from_our_table():
    raw = {
        "memory_tier_stall": {"value": 0.015, "target": 99.0, "ok": False, "detail": {"k": 5}},
        "peer_restore_vs_disk": {"value": 0.6, "target": 99.0, "ok": True, "detail": {}},
    }
    stall, restore = m.memory_metrics(raw)
    assert (stall.name, stall.value, stall.target, stall.ok) == (
        "memory_tier_stall",
        0.015,
        0.02,
        True,
    )
    assert stall.detail == {"k": 5}
    assert (restore.target, restore.ok) == (0.5, False)
    with pytest.raises(KeyError):
        m.memory_metrics({"memory_stall": {"value": 0.0, "detail": {}}})


def test_launch_module_wraps_the_trainer_in_the_warm_launcher():
    from bench.elastic_runs import launch_module

    assert launch_module(["--config", "x"], warm=False) == ("trainer", ["--config", "x"])
    assert launch_module(["--config", "x"], warm=True) == (
        "warmstart",
        ["-m", "trainer", "--config", "x"],
    )


def test_warm_available_follows_the_module(tmp_path, monkeypatch):
    from bench import elastic_runs

    (tmp_path / "bench_fake_launcher.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setattr(elastic_runs, "WARM_MODULE", "bench_fake_launcher")
    assert elastic_runs.warm_available()
    monkeypatch.setattr(elastic_runs, "WARM_MODULE", "bench_no_such_launcher_here")
    assert not elastic_runs.warm_available()


class _FakeJob:
    """Stands in for bench.harness.local_cluster.ElasticJob: records what elastic_run asks for."""

    made: list[_FakeJob] = []

    def __init__(
        self, workdir, trainer_args, module="trainer", max_restarts=3, env=None, rdzv_backend="c10d"
    ):
        self.workdir, self.trainer_args, self.module = workdir, trainer_args, module
        self.rdzv_backend = rdzv_backend
        self.max_restarts, self.env = max_restarts, env or {}
        self.agent_env: list[dict] = []
        self.agents: list = []
        self.closed = False
        _FakeJob.made.append(self)

    def add_agent(self, env=None):
        self.agent_env.append(env or {})
        os.makedirs(env["CKPT_MEMORY_DIR"], exist_ok=True)  # as a worker would

    def wait_agents(self, timeout_s):
        return {"agent0": 0, "agent1": 0}

    def metrics(self):
        return [{"step": 1}]

    def all_events(self):
        return [{"event": "start"}]

    def close(self):
        self.closed = True


@pytest.mark.parametrize("warm", [False, True])
def test_elastic_run_launches_warm_or_plain_with_the_memory_tier_per_node(
    tmp_path, monkeypatch, warm
):
    import bench.harness.local_cluster
    from bench.elastic_runs import elastic_run, fault_spec

    _FakeJob.made.clear()
    monkeypatch.setattr(bench.harness.local_cluster, "ElasticJob", _FakeJob)
    out = elastic_run(str(tmp_path), 50, [12, 30], 10, 60, warm=warm, memory_every=1)
    (job,) = _FakeJob.made
    assert job.closed
    assert out["launcher"] == ("warmstart" if warm else "plain")
    assert out["metrics"] == [{"step": 1}] and out["events"] == [{"event": "start"}]
    if warm:
        assert job.module == "warmstart" and job.trainer_args[:2] == ["-m", "trainer"]
    else:
        assert job.module == "trainer" and job.trainer_args[0] == "--config"
    args = job.trainer_args
    assert args[args.index("--max-steps") + 1] == "50"
    assert args[args.index("--ckpt-every") + 1] == "10"
    assert "checkpoint.memory_every=1" in args and "checkpoint.async_save=true" in args
    assert job.max_restarts == 2
    # Always agent 0's worker: its agent keeps the highest restart count, so every
    # attempt's kill fires once.
    assert "TRAINER_FAULTS" not in job.env
    assert [e["TRAINER_FAULTS"] for e in job.agent_env] == [fault_spec([12, 30]), ""]
    assert fault_spec([12, 30]) == "kill:step=12:attempt=0;kill:step=30:attempt=1"
    dirs = [e["CKPT_MEMORY_DIR"] for e in job.agent_env]
    assert len(set(dirs)) == 2  # each agent a node of its own
    assert not any(os.path.exists(d) for d in dirs)  # removed after the job

    assert job.rdzv_backend == "c10d" and out["rdzv_backend"] == "c10d"

    _FakeJob.made.clear()
    out = elastic_run(str(tmp_path), 50, [12], 10, 60, rdzv_backend="ft")
    assert not any("memory_every" in a for a in _FakeJob.made[0].trainer_args)
    assert _FakeJob.made[0].rdzv_backend == "ft" and out["rdzv_backend"] == "ft"


def _plans() -> list:
    from bench.__main__ import KILL_PLAN
    from bench.fault_cost import KillPlan

    return [KILL_PLAN] + [KillPlan.sized(step_s) for step_s in (0.05, 0.11, 0.22, 0.5, 3.0)]


@pytest.mark.parametrize("which", range(6))
def test_kill_plan_spreads_the_kills_over_the_durable_interval(which):
    plan = _plans()[which]
    kills = list(plan.kill_steps)
    assert kills == sorted(kills) and kills[-1] < plan.max_steps
    # A kill fires before its step: the durable-only job re-runs (step - 1) % N steps.
    reruns = [(k - 1) % plan.durable_every for k in kills]
    assert len(set(reruns)) == len(reruns) and 0 not in reruns
    assert statistics.mean(reruns) == plan.durable_every / 2
    assert plan.memory_every == 5
    # ... and the memory tier re-runs fewer, but not always none.
    memory_reruns = [(k - 1) % plan.memory_every for k in kills]
    assert max(memory_reruns) > 0 and sum(memory_reruns) < sum(reruns)
    assert plan.settings()["kill_steps"] == kills


@pytest.mark.parametrize("step_s", [0.05, 0.11, 0.15, 0.22, 0.3])
def test_a_kill_plan_is_sized_for_a_fault_about_every_30_s_of_its_step_time(step_s):
    from bench.fault_cost import FAULT_EVERY_S, PERIOD_OVERHEAD_S, KillPlan

    plan = KillPlan.sized(step_s)
    # Four periods (start -> kill, kill -> kill, kill -> kill, kill -> end) of about the
    # same number of steps, each about FAULT_EVERY_S seconds with its overhead.
    bounds = [0, *plan.kill_steps, plan.max_steps]
    periods = [b - a for a, b in itertools.pairwise(bounds)]
    assert max(periods) - min(periods) <= 12
    # Steps apart are a multiple of the durable interval (20): off by 10 steps at most,
    # and the periods are 3 steps longer on average (the re-runs' offsets 8/10/12).
    mean_s = statistics.mean(periods) * step_s + PERIOD_OVERHEAD_S
    assert abs(mean_s - FAULT_EVERY_S) <= 13 * step_s + 0.01
    # The default plan is the one sized for 0.22 s steps.
    assert KillPlan.sized(0.22) == KillPlan()
    with pytest.raises(ValueError, match="step time"):
        KillPlan.sized(0.0)


T0 = datetime.datetime(2026, 11, 23, 12, 0, 0).timestamp()


def _row(step: int, t: float, restart: int, step_time: float = 0.5) -> dict:
    return {"step": step, "time": T0 + t, "step_time_s": step_time, "restart_count": restart,
            "world_size": 2, "loss": 1.0}  # fmt: skip


def _trainer_line(t: float, text: str) -> str:
    stamp = datetime.datetime.fromtimestamp(T0 + t).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    return f"{stamp} [rank 0] INFO trainer: {text}"


def _torch_line(t: float, text: str) -> str:
    stamp = datetime.datetime.fromtimestamp(T0 + t).strftime("%m%d %H:%M:%S.%f")
    return f"E{stamp} 4242 torch/distributed/elastic/multiprocessing/api.py:1 {text}"


def _two_kills() -> tuple[list[dict], list[dict], list[str]]:
    """Rows of a run killed after step 6 (durable checkpoint at 4: steps 5, 6 re-run) and
    after step 9 (memory snapshot of 9: nothing re-run); logs only for the first kill."""
    rows = [_row(s, s, 0) for s in range(1, 7)]  # steps 1-6 end at t=1..6
    rows += [_row(s, 20 + s - 5, 1) for s in range(5, 10)]  # resumed at 4: 5-9, t=20..24
    rows += [_row(s, 30 + s - 10, 2, 0.25) for s in range(10, 13)]  # resumed at 9: t=30..32
    events = [
        {"event": "fault", "time": T0 + 6.001, "step": 7, "rank": 1},
        {"event": "resume", "time": T0 + 19.0, "step": 4, "duration_s": 2.0},
        {"event": "checkpoint_loaded", "time": T0 + 18.9, "step": 4, "duration_s": 1.5},
        {"event": "start", "time": T0 + 19.1, "step": 4},
        {"event": "resume", "time": T0 + 29.5, "step": 9, "duration_s": 0.5, "tier": "memory"},
    ]
    logs = [
        "\n".join([
            _torch_line(7.0, "failed (exitcode: -9) local_rank: 0 (pid: 1) of binary: python"),
            _trainer_line(12.0, "rank 0/2: process group ready (backend=gloo, device=cpu)"),
            _trainer_line(15.0, "rank 0: looking for a committed checkpoint under /x"),
        ])
    ]  # fmt: skip
    return rows, events, logs


def test_attempt_starts_are_the_report_attempts():
    from bench.elastic_runs import attempt_starts
    from trainer.report import split_attempts

    rows, _, _ = _two_kills()
    assert attempt_starts(rows) == [6, 11]
    assert [a.rows for a in split_attempts(rows, 0.0)] == [6, 5, 3]
    from bench.elastic_runs import restarts

    rows, events, logs = _two_kills()
    first, second = restarts(rows, events, logs)
    assert (first["attempt"], first["killed_after_step"], first["rerun_from_step"]) == (1, 6, 5)
    assert first["overhead_s"] == pytest.approx(14.0 - 1.5)  # minus checkpoint_loaded
    assert first["detect_s"] == pytest.approx(1.0, abs=1e-3)
    assert (second["attempt"], second["load_s"]) == (2, 0.0)
    # A resume that re-runs steps without a restart count (an in-process restart) is one too.
    same = [_row(1, 1, 0), _row(2, 2, 0), _row(2, 9, 0), _row(3, 10, 0)]
    assert attempt_starts(same) == [2]


def test_fault_cost_is_downtime_plus_rerun_per_kill():
    from bench.fault_cost import fault_cost, phase_medians
    from trainer.report import summarize

    rows, events, logs = _two_kills()
    cost = fault_cost(rows, events, logs, kills=2)
    first, second = cost["per_kill"]
    # Kill 1: last row t=6, next attempt's first step starts at 20 - 0.5 = 19.5.
    assert first["downtime_s"] == pytest.approx(13.5)
    assert (first["rerun_steps"], first["rerun_s"]) == (2, 1.0)  # steps 5, 6 of attempt 0
    assert first["lost_s"] == pytest.approx(14.5)
    assert (first["killed_after_step"], first["resumed_from_step"]) == (6, 4)
    assert first["tier"] == "durable"
    assert first["load_s"] == 2.0  # the resume event (tier choice + read + load)
    assert first["detect_s"] == pytest.approx(1.0, abs=1e-3)
    assert first["rdzv_spawn_import_pg_s"] == pytest.approx(5.0, abs=1e-3)
    assert first["build_s"] == pytest.approx(3.0, abs=1e-3)
    assert first["other_s"] == pytest.approx(13.5 - 9.0 - 2.0, abs=1e-3)
    assert first["restart_s"] == pytest.approx(11.5)
    # Kill 2: last row t=24, first step after starts at 30 - 0.25; memory tier, no re-run.
    assert second["downtime_s"] == pytest.approx(5.75)
    assert (second["rerun_steps"], second["rerun_s"], second["tier"]) == (0, 0.0, "memory")
    assert second["resumed_from_step"] == 9
    assert "detect_s" not in second  # no log marks for it
    s = summarize(rows, events)
    assert cost["fault_cost_s"] == pytest.approx((s.downtime_s + s.rerun_time_s) / 2)
    assert cost["fault_cost_s"] == pytest.approx((14.5 + 5.75) / 2)
    assert cost["goodput"] == s.goodput
    assert cost["mean_s_between_faults"] == pytest.approx(s.wall_time_s / 3)
    med = phase_medians(cost["per_kill"])
    assert med["rerun_s"] == 0.5 and med["detect_s"] == pytest.approx(1.0, abs=1e-3)
    assert med["lost_s"] == pytest.approx((14.5 + 5.75) / 2)


def test_fault_cost_counts_a_slow_first_step_after_the_resume_apart():
    from bench.fault_cost import fault_cost, phase_medians

    rows, events, logs = _two_kills()
    assert rows[6]["step"] == 5 and rows[6]["restart_count"] == 1  # first step of attempt 1
    plain = fault_cost(rows, events, logs, kills=2)
    assert plain["first_step_excess_s"] == 0.0  # both first steps at (or under) the median
    assert plain["fault_cost_with_first_step_s"] == pytest.approx(plain["fault_cost_s"])
    rows[6] = _row(5, 20, 1, step_time=1.5)  # same end, 1 s slower than the median 0.5
    cost = fault_cost(rows, events, logs, kills=2)
    first, second = cost["per_kill"]
    assert first["first_step_s"] == 1.5 and first["first_step_excess_s"] == pytest.approx(1.0)
    assert second["first_step_s"] == 0.25 and second["first_step_excess_s"] == 0.0
    assert first["downtime_s"] == pytest.approx(20 - 1.5 - 6)  # ends where that step starts
    assert cost["first_step_excess_s"] == pytest.approx(1.0)
    assert cost["fault_cost_with_first_step_s"] == pytest.approx(cost["fault_cost_s"] + 0.5)
    assert phase_medians(cost["per_kill"])["first_step_excess_s"] == pytest.approx(0.5)
    detail = m.fault_cost_metric(cost, plain).detail
    assert detail["ours_with_first_step_s"] == pytest.approx(cost["fault_cost_s"] + 0.5)
    assert detail["memory_tier"]["first_step_excess_s"] == pytest.approx(1.0)


def test_fault_cost_refuses_a_run_whose_restarts_are_not_the_kills():
    from bench.fault_cost import fault_cost

    rows, events, logs = _two_kills()
    with pytest.raises(ValueError, match="3 kills injected but 2 restarts"):
        fault_cost(rows, events, logs, kills=3)
    no_kill = fault_cost(rows[:6], events, logs)
    assert no_kill["kills"] == 0 and math.isnan(no_kill["fault_cost_s"])


def test_fault_cost_metric_has_both_tiers():
    from bench.fault_cost import fault_cost

    rows, events, logs = _two_kills()
    ours = fault_cost(rows, events, logs, kills=2)
    base = {**ours, "fault_cost_s": 20.25, "per_kill": ours["per_kill"][:1]}
    metric = m.fault_cost_metric(ours, base, launcher="plain")
    assert metric.name == "fault_cost_s"
    assert metric.value == pytest.approx(10.125)
    assert not metric.ok  # > 2 s
    d = metric.detail
    assert d["baseline_fault_cost_s"] == 20.25 and d["vs_baseline"] == 0.5
    assert d["launcher"] == "plain"
    assert len(d["memory_tier"]["per_kill"]) == 2 and len(d["durable_only"]["per_kill"]) == 1
    assert d["memory_tier"]["median_per_kill_s"]["lost_s"] == pytest.approx(10.125)
    json.dumps(d)  # JSON-able
    assert m.fault_cost_metric({**ours, "fault_cost_s": 1.9}, base).ok


def test_restart_metric_reports_the_plain_launcher_beside_the_warm_one():
    warm = [{"overhead_s": 2.0, "load_s": 0.1}, {"overhead_s": 2.8, "load_s": 0.1}]
    plain = [{"overhead_s": 8.0, "detect_s": 0.1}, {"overhead_s": 6.0, "detect_s": 0.3}]
    metric = m.restart_metric(warm, [2.0, 2.0, 4.0], plain_launcher=plain, launcher="warmstart")
    assert metric.value == pytest.approx(2.4 / 2.0)
    assert metric.ok  # 1.2 is on the target
    assert metric.detail["launcher"] == "warmstart"
    assert metric.detail["plain_launcher_value"] == 3.5
    assert metric.detail["plain_launcher"]["median_detect_s"] == 0.2
    failed = m.restart_metric(warm, [2.0], plain_launcher="failed: boom")
    assert failed.detail["plain_launcher"] == "failed: boom"
    assert "plain_launcher" not in m.restart_metric(warm, [2.0]).detail


def test_restart_metric_reports_c10d_beside_our_rendezvous():
    ours = [{"overhead_s": 2.0, "load_s": 0.1}, {"overhead_s": 2.0, "load_s": 0.1}]
    c10d = [{"overhead_s": 5.0, "detect_s": 0.1}, {"overhead_s": 7.0, "detect_s": 0.3}]
    metric = m.restart_metric(ours, [2.0], c10d=c10d, rdzv_backend="ft")
    assert metric.value == pytest.approx(1.0)
    assert metric.detail["rdzv_backend"] == "ft"
    assert metric.detail["c10d_value"] == 3.0
    assert metric.detail["c10d"]["ours_median_s"] == 6.0
    assert metric.detail["c10d"]["median_detect_s"] == 0.2
    assert "plain_launcher" not in metric.detail
    assert m.restart_metric(ours, [2.0], c10d="failed: x").detail["c10d"] == "failed: x"


def test_rendezvous_metric_uses_the_largest_n_where_both_backends_ran_the_round():
    def row(backend, n, first, reround=1.0):
        return {"backend": backend, "n": n, "first_round_s": first, "reround_s": reround}

    rows = [
        row("c10d", 8, 1.5),
        row("ft", 8, 0.06),
        row("c10d", 32, 6.0),
        row("ft", 32, 0.3),
        {"backend": "c10d", "n": 128, "error": "TimeoutError: while starting"},
        row("ft", 128, 0.5),
    ]
    metric = m.rendezvous_metric(rows)
    assert metric.value == pytest.approx(0.05)
    assert metric.detail["n"] == 32 and metric.detail["largest_n_simulated"] == 128
    assert metric.detail["not_measured"] == ["c10d N=128: TimeoutError: while starting"]
    assert "c10d_timed_out" not in metric.detail
    assert metric.detail["ratios"]["N=8"]["first_round_s"] == pytest.approx(0.04)
    assert metric.ok
    # c10d's round did not finish within the phase timeout: its timeout is a lower bound.
    timed_out = {
        "backend": "c10d", "n": 256, "timed_out": "first_round_s",
        "first_round_at_least_s": 120.0, "error": "first_round_s: 200 of 256 agents done",
    }  # fmt: skip
    bounded = m.rendezvous_metric([*rows, timed_out, row("ft", 256, 1.2)])
    assert bounded.detail["n"] == 256 and bounded.detail["c10d_timed_out"] is True
    assert bounded.value == pytest.approx(0.01)
    assert "first_round_s (c10d timed out: upper bound)" in bounded.detail["ratios"]["N=256"]
    none = m.rendezvous_metric([rows[4], rows[5]])
    assert math.isnan(none.value) and not none.ok
    assert none.detail["status"] == "no N where both backends ran the round"


def test_progress_line_names_the_task_its_time_and_each_metric_as_it_landed():
    from bench.__main__ import task_done_line

    got = [m.Metric(name="save_vs_dcp", value=0.7), m.missing("save_memory", "boom")]
    line = task_done_line(2, 5, "save", "save rounds", 12.3, 40.0, got)
    assert line.startswith("[2/5] save: save rounds done in 12 s (elapsed 40 s)")
    assert "save_vs_dcp=0.700 (ok, <= 1)" in line
    assert "save_memory=NaN (miss, <= 0.5)" in line
    assert "no metric" in task_done_line(1, 1, "gcs", "gcs", 1.0, 1.0, [])


@pytest.mark.timeout(300)
def test_quick_run_prints_progress_per_task(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--only", "rendezvous", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    err = result.stderr
    assert "[1/1] rendezvous: rendezvous simulation ..." in err
    assert "[1/1] rendezvous: rendezvous simulation done in" in err
    assert "rendezvous_vs_c10d=" in err.split("done in", 1)[1]
    # the lines inside a task say how long the run has been going
    assert re.search(r"bench: rendezvous: ft N=8: .* \(elapsed \d+ s\)\n", err), err[-2000:]


@pytest.mark.timeout(30)
def test_bench_modules_never_import_the_unshipped_testing_package() -> None:
    # `bench` is installed with the package and `testing/` is not: any import of testing
    # (at the top or inside a group's function) would break `python -m bench` from a wheel
    import ast
    from pathlib import Path

    offenders = []
    for path in sorted(Path(bench.__file__).parent.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "testing"]
    assert not offenders, offenders


def test_survivor_exit_is_torchruns_sigterm_to_its_report_of_the_group_exit():
    from bench.fault_cost import survivor_exits

    log = "\n".join([
        _torch_line(7.0, "Sending process 11 closing signal SIGTERM"),
        _torch_line(7.02, "Sending process 12 closing signal SIGTERM"),  # same group: first counts
        _torch_line(7.3, "failed (exitcode: -9) local_rank: 1 (pid: 13) of binary: python"),
        _torch_line(9.0, "failed (exitcode: 1) local_rank: 0 (pid: 14) of binary: python"),  # no SIGTERM
        _torch_line(20.0, "Sending process 21 closing signal SIGTERM"),
        _torch_line(25.25, "failed (exitcode: -9) local_rank: 1 (pid: 22) of binary: python"),
    ])  # fmt: skip
    assert survivor_exits([log], 2026) == [pytest.approx(0.3), pytest.approx(5.25)]
    assert survivor_exits(["no marks"], 2026) == []


def test_loader_metrics_are_the_jobs_cost_and_its_slowest_survivor():
    from bench.fault_cost import fault_cost

    rows, events, logs = _two_kills()
    job = {"cost": fault_cost(rows, events, logs, kills=2), "survivor_exit_s": [0.02, 0.4],
           "num_workers": 2, "launcher": "warmstart", "rdzv_backend": "ft", "job_wall_s": 30.0}  # fmt: skip
    cost, exits = m.loader_metrics(job)
    assert (cost.name, cost.value) == ("loader_fault_cost_s", job["cost"]["fault_cost_s"])
    assert not cost.ok  # (14.5 + 5.75) / 2 s per kill
    assert (exits.name, exits.value, exits.ok) == ("loader_survivor_exit_s", 0.4, True)
    assert exits.detail["each_s"] == [0.02, 0.4]
    job["survivor_exit_s"] = [0.02, 5.1]
    assert not m.loader_metrics(job)[1].ok


@pytest.mark.timeout(240)
def test_a_wheel_carries_what_the_bench_runs_and_the_bench_starts_from_it(tmp_path) -> None:
    """``pip install .`` ships the configs and the harnesses the groups run: the bench works
    from the installed packages alone, in any directory (no checkout on the path)."""
    import zipfile

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), repo],
        capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(site)
    assert "trainer/configs/tiny_gpt.toml" in names
    harnesses = {
        "local_cluster",
        "gcs_emulator",
        "s3_server",
        "seaweedfs",
        "server_process",
        "ports",
    }
    assert {f"bench/harness/{h}.py" for h in harnesses} <= set(names)
    assert not [n for n in names if n.split("/")[0] in {"testing", "tests", "examples"}]
    code = (
        "import os, bench, bench.gpt, bench.harness.local_cluster, bench.harness.gcs_emulator\n"
        "import bench.harness.s3_server, bench.harness.seaweedfs\n"
        "import trainer.config\n"
        "assert bench.__file__.startswith(os.environ['SITE']), bench.__file__\n"
        "cfg = trainer.config.load_config(bench.gpt.CONFIG)\n"
        "print(cfg.model.d_model, bench.harness.local_cluster.REPO == os.environ['SITE'])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "SITE": str(site)}
    ran = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env=env, cwd=str(tmp_path),
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split()[1] == "True"
    helped = subprocess.run(
        [sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, timeout=120,
        env=env, cwd=str(tmp_path),
    )  # fmt: skip
    assert helped.returncode == 0 and "--quick" in helped.stdout


def test_bench_exits_non_zero_when_a_group_fails_to_produce_its_metrics(
    tmp_path, monkeypatch, capsys
):
    import bench.__main__ as b

    def broken(*args, **kwargs):
        raise RuntimeError("the harness broke")

    monkeypatch.setattr(b, "_rendezvous", broken)
    assert b.main(["--quick", "--only", "rendezvous", "--dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "group rendezvous failed to produce its metrics: rendezvous simulation" in out


def test_replicated_metrics_divide_bytes_read_by_the_checkpoints_and_time_by_time():
    raw = {
        "checkpoint_bytes": 1000,
        "ranks": 4,
        "once_s": [9.0, 1.0, 3.0, 2.0],  # round 0 is a warm-up
        "each_s": [9.0, 4.0, 4.0, 4.0],
        "once_bytes": [9999, 1010, 1000, 1020],
        "each_bytes": [9999, 4000, 4000, 4000],
    }
    amplification, ratio = m.replicated_metrics(raw)
    assert amplification.name == "read_amplification" and amplification.value == 1.01
    assert amplification.detail["read_by_each_amplification"] == 4.0
    assert ratio.name == "read_once_load_vs_each" and ratio.value == 0.5 and ratio.ok


def test_scale_metrics_compare_at_the_largest_point_dcp_ran():
    raw = {
        "tensors": 8,
        "points": [
            {"ranks": 4, "ours_s": 0.001, "dcp_s": 0.1,
             "ours_bytes_per_rank": 100, "dcp_bytes_per_rank": 1000},
            {"ranks": 16, "ours_s": 0.004, "dcp_s": 0.8,
             "ours_bytes_per_rank": 100, "dcp_bytes_per_rank": 1000},
            {"ranks": 64, "ours_s": 0.016,
             "ours_bytes_per_rank": 120, "dcp_bytes_per_rank": 2400},
        ],
    }  # fmt: skip
    vs_dcp, exponent, sent = m.scale_metrics(raw)
    assert vs_dcp.value == pytest.approx(0.004 / 0.8) and "16 ranks" in vs_dcp.detail["at"]
    assert exponent.value == pytest.approx(1.0)  # ours grows linearly in R here
    assert exponent.detail["dcp_exp"] == pytest.approx(1.5)
    assert sent.value == pytest.approx(0.05)


def test_the_scale_simulation_runs_our_coordinator_beside_dcps_planner():
    from bench.scale import point

    got = point(4, 8, rounds=1, with_dcp=True)
    assert got["ours_s"] > 0 and got["dcp_s"] > 0
    # 16 bytes per item and a digest against DCP's pickled plans and results
    assert got["ours_bytes_per_rank"] < got["dcp_bytes_per_rank"] / 3
