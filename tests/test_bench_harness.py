"""The benchmark harness: imports, --help, the table of targets, --only, the metric math.

Pure functions only (no ranks are spawned, no timing is asserted).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import pkgutil
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
    ("restart_overhead", 2.0, "<="),
    ("ettr", 0.90, ">="),
    ("silent_node_loss", 15.0, "<="),
    ("gcs_save_vs_pipe", 0.80, ">="),
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
    assert list(m.GROUPS) == ["save", "load", "async", "overhead", "gcs", "elastic"]
    grouped = [name for names in m.GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(m.TARGETS)
    assert m.GROUPS["load"] == ("load_vs_disk", "reshard_load")
    assert m.GROUPS["elastic"] == ("restart_overhead", "ettr", "silent_node_loss")


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
        "target": 0.90,
        "ok": False,
        "detail": {"status": "full mode only"},
    }


def test_complete_orders_by_table_and_fills_the_rest():
    produced = [
        m.Metric(name="gcs_save_vs_pipe", value=0.9, detail={"x": 1}),
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
    assert "save, load, async, overhead, gcs, elastic" in err


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
