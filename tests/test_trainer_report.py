"""Run report: summarize() on synthetic runs with known answers, and the report CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainer.__main__ import main as trainer_main
from trainer.report import (
    Attempt,
    RunReportError,
    format_summary,
    load_run_dir,
    main,
    summarize,
    timeline_marks,
    transition_label,
)

pytestmark = pytest.mark.timeout(120)

T0 = 1_000_000.0
"""Unix time at which the first synthetic step starts."""


def rows(steps, *, start, step_s=1.0, world=2, restart=0, loss0=3.0):
    """Metrics rows for consecutive ``steps``, the first one starting at ``T0 + start``."""
    out = []
    for i, step in enumerate(steps):
        out.append({
            "step": step, "loss": loss0 - 0.01 * step, "lr": 1e-3, "world_size": world,
            "restart_count": restart, "time": T0 + start + (i + 1) * step_s,
            "step_time_s": step_s, "tokens_per_s": 1.0, "data_cursor": step, "grad_norm": 1.0,
            "samples_digest": "x",
        })  # fmt: skip
    return out


def ckpt(step, at, *, nbytes=100, duration=0.5, **extra):
    return {"event": "checkpoint_saved", "step": step, "time": T0 + at, "bytes": nbytes,
            "duration_s": duration, **extra}  # fmt: skip


def ev(name, step, at, **extra):
    return {"event": name, "step": step, "time": T0 + at, **extra}


# Uninterrupted: steps 1..10, 1 s each, from t=0 to t=10; checkpoints at 5 and 10.
UNINTERRUPTED = (
    rows(range(1, 11), start=0),
    [ev("start", 0, 0), ckpt(5, 5.2), ckpt(10, 10.2, nbytes=300, duration=1.5),
     ev("finished", 10, 10.3)],
)  # fmt: skip

# One restart: attempt 0 runs 1..8 (t 0-8), dies; checkpoint at 6. Attempt 1 starts its first
# step at t=20 (12 s down), re-runs 7..8 and goes on to 10 (t 20-24). Re-run: steps 7, 8 of
# attempt 0 (2 s). Productive: 10 steps = 10 s. Wall 24 s.
ONE_RESTART = (
    rows(range(1, 9), start=0) + rows(range(7, 11), start=20, restart=1),
    [ev("start", 0, 0), ckpt(6, 6.1), ev("fault", 9, 8.05, spec="kill:step=9"),
     ev("resume", 6, 19.5, restart_count=1), ev("start", 6, 19.6, restart_count=1),
     ckpt(10, 24.1), ev("finished", 10, 24.2)],
)  # fmt: skip

# World size 2 -> 3 without losing steps: attempt 0 steps 1..5 (t 0-5), scale-up, attempt 1 (same
# restart count 1 as a torchrun membership change) steps 6..9 starting at t=8 (3 s down).
WORLD_CHANGE = (
    rows(range(1, 6), start=0) + rows(range(6, 10), start=8, world=3, restart=1),
    [ckpt(5, 5.1), ev("preempted", 5, 5.2, emergency_save=True), ckpt(9, 12.1)],
)

# No checkpoints, no events at all.
NO_CHECKPOINTS = (rows(range(1, 4), start=0, step_s=2.0), [])

CASES = {
    "uninterrupted": (
        UNINTERRUPTED,
        {"steps_completed": 10, "steps_executed": 10, "rerun_steps": 0, "max_restart_count": 0,
         "distinct_attempts": 1, "world_sizes": [(0.0, 2)], "checkpoints_committed": 2,
         "last_checkpoint_step": 10, "checkpoint_bytes": 400, "checkpoint_mean_duration_s": 1.0,
         "emergency_checkpoints": 0, "faults_injected": 0, "fallbacks": 0, "downtime_s": 0.0,
         "rerun_time_s": 0.0, "time_lost_s": 0.0, "productive_time_s": 10.0, "wall_time_s": 10.0,
         "goodput": 1.0, "first_loss": 2.99, "final_loss": 2.9, "finished": True},
    ),
    "one_restart": (
        ONE_RESTART,
        {"steps_completed": 10, "steps_executed": 12, "rerun_steps": 2, "max_restart_count": 1,
         "distinct_attempts": 2, "world_sizes": [(0.0, 2)], "checkpoints_committed": 2,
         "last_checkpoint_step": 10, "faults_injected": 1, "downtime_s": 12.0,
         "rerun_time_s": 2.0, "time_lost_s": 14.0, "productive_time_s": 10.0,
         "wall_time_s": 24.0, "goodput": 10.0 / 24.0, "finished": True},
    ),
    "world_change": (
        WORLD_CHANGE,
        {"steps_completed": 9, "steps_executed": 9, "rerun_steps": 0, "max_restart_count": 1,
         "distinct_attempts": 2, "world_sizes": [(0.0, 2), (8.0, 3)], "checkpoints_committed": 2,
         "emergency_checkpoints": 1, "downtime_s": 3.0, "time_lost_s": 3.0,
         "productive_time_s": 9.0, "wall_time_s": 12.0, "goodput": 0.75, "finished": False},
    ),
    "no_checkpoints": (
        NO_CHECKPOINTS,
        {"steps_completed": 3, "checkpoints_committed": 0, "last_checkpoint_step": None,
         "checkpoint_bytes": 0, "checkpoint_mean_duration_s": None, "wall_time_s": 6.0,
         "goodput": 1.0, "distinct_attempts": 1, "finished": False},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_summarize_known_answers(name):
    (metrics, events), expected = CASES[name]
    summary = summarize(metrics, events)
    got = summary.to_json()
    got["world_sizes"] = [tuple(pair) for pair in got["world_sizes"]]
    for key, want in expected.items():
        if isinstance(want, list):
            assert got[key] == want, key
        else:
            assert got[key] == pytest.approx(want), key


def test_restart_with_same_world_and_count_is_split_when_step_goes_back():
    # A step that does not increase starts a new attempt even if nothing else changed.
    metrics = rows(range(1, 5), start=0) + rows(range(3, 6), start=10)
    summary = summarize(metrics, [])
    assert [(a.first_step, a.last_step) for a in summary.attempts] == [(1, 4), (3, 5)]
    assert summary.rerun_steps == 2
    assert summary.downtime_s == pytest.approx(6.0)


def test_empty_metrics_is_a_clear_error():
    with pytest.raises(RunReportError, match="no metrics rows"):
        summarize([], [ev("start", 0, 0)])


def test_empty_run_dir_is_a_clear_error(tmp_path):
    with pytest.raises(RunReportError, match=r"no metrics\.jsonl"):
        load_run_dir(str(tmp_path))


def test_text_summary_names_world_sizes_and_goodput():
    text = format_summary(summarize(*WORLD_CHANGE))
    assert "2 (0-5 s) -> 3 (8-12 s)" in text
    assert "75.0 %" in text
    assert "1 emergency" in text


def write_run(run_dir, metrics, events, *, torn_tail=False):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in metrics)
        if torn_tail:
            fh.write('{"step": 99, "lo')
    with open(os.path.join(run_dir, "events.jsonl"), "w") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in events)


def test_report_main_writes_png_and_prints_summary(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    write_run(run_dir, *ONE_RESTART, torn_tail=True)
    assert main([run_dir]) == 0
    out = capsys.readouterr().out
    assert "goodput        41.7 %" in out
    assert "time lost      14.0 s" in out
    with open(os.path.join(run_dir, "timeline.png"), "rb") as fh:
        data = fh.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000


def test_report_main_json_and_out_path(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    write_run(run_dir, *WORLD_CHANGE)
    out_png = str(tmp_path / "elsewhere.png")
    assert main([run_dir, "--json", "--out", out_png]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["world_sizes"] == [[0.0, 2], [8.0, 3]]
    assert payload["timeline_png"] == out_png
    assert os.path.getsize(out_png) > 20_000
    assert not os.path.exists(os.path.join(run_dir, "timeline.png"))


def test_cli_subcommand_writes_png(tmp_path):
    run_dir = str(tmp_path / "run")
    write_run(run_dir, *UNINTERRUPTED)
    cmd = [sys.executable, "-m", "trainer", "report"]
    ok = subprocess.run([*cmd, run_dir], capture_output=True, text=True, timeout=100)
    assert ok.returncode == 0, ok.stderr
    assert "goodput        100.0 %" in ok.stdout
    with open(os.path.join(run_dir, "timeline.png"), "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def write_rank_events(run_dir, rank, events):
    with open(os.path.join(run_dir, f"events.rank{rank}.jsonl"), "a") as fh:
        fh.writelines(json.dumps({**e, "rank": rank}) + "\n" for e in events)


def test_the_report_reads_only_event_names_the_schema_defines():
    from runcore.events import SCHEMA
    from trainer.report import DETECTOR_EVENTS, FAILURE_EVENTS, FAULT_EVENTS, WATCHDOG_EVENTS

    for names in (FAULT_EVENTS, FAILURE_EVENTS, WATCHDOG_EVENTS, DETECTOR_EVENTS):
        assert names and set(names) <= set(SCHEMA), sorted(set(names) - set(SCHEMA))


def test_rank_event_files_are_merged_counted_and_drawn(tmp_path, capsys):
    # ONE_RESTART, but the fault was injected on rank 1: rank 0's events.jsonl has none.
    metrics, events = ONE_RESTART
    rank0 = [e for e in events if e["event"] != "fault"]
    run_dir = str(tmp_path / "run")
    write_run(run_dir, metrics, rank0)
    write_rank_events(run_dir, 1, [ev("fault", 9, 8.05, spec="kill:step=9,rank=1")])
    write_rank_events(run_dir, 3, [ev("peer_silent", 9, 8.5, peer=2, silent_s=5.0),
                                   ev("watchdog_stall", 9, 8.6)])  # fmt: skip

    loaded_metrics, merged = load_run_dir(run_dir)
    times = [e["time"] for e in merged]
    assert times == sorted(times) and len(merged) == len(rank0) + 3
    assert [(e["event"], e["rank"]) for e in merged if e["event"] in {"fault", "peer_silent"}] == [
        ("fault", 1),
        ("peer_silent", 3),
    ]
    assert all(e["rank"] == 0 for e in merged if e["event"] == "start")  # default: file's rank

    summary = summarize(loaded_metrics, merged)
    assert summary.faults_injected == 1 and summary.fault_ranks == [1]
    assert summary.failures == 1 and summary.watchdog_stalls == 1
    assert summary.event_ranks == [0, 1, 3]
    assert not summary.notes  # the restart is explained by the fault
    text = format_summary(summary)
    assert "1 injected (on rank 1)" in text
    assert "1 reported, 1 watchdog stall" in text and "events from ranks 0, 1, 3" in text

    marks = timeline_marks(merged, summary.start_time)
    assert marks["fault"] == [(pytest.approx(8.05), 9, 1)]
    assert [rank for _, _, rank in marks["failure"]] == [3]
    assert [rank for _, _, rank in marks["watchdog"]] == [3]

    assert main([run_dir, "--json"]) == 0  # draws timeline.png with the rank-1 fault on it
    payload = json.loads(capsys.readouterr().out)
    assert payload["faults_injected"] == 1 and payload["fault_ranks"] == [1]
    assert payload["failures"] == 1
    with open(os.path.join(run_dir, "timeline.png"), "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert main([run_dir, "--no-plot"]) == 0
    assert "faults         1 injected (on rank 1)" in capsys.readouterr().out


def test_faults_from_two_ranks_are_two_events(tmp_path):
    metrics, events = ONE_RESTART  # its fault event (no rank field) is in rank 0's file
    run_dir = str(tmp_path / "run")
    write_run(run_dir, metrics, events)
    write_rank_events(run_dir, 1, [ev("fault", 9, 8.05, spec="kill:step=9")])
    summary = summarize(*load_run_dir(run_dir))
    assert summary.faults_injected == 2 and summary.fault_ranks == [0, 1]
    assert "2 injected (on ranks 0, 1)" in format_summary(summary)


def test_restart_without_any_recorded_fault_has_a_note():
    metrics, events = ONE_RESTART
    summary = summarize(metrics, [e for e in events if e["event"] != "fault"])
    assert summary.faults_injected == 0 and summary.fault_ranks == []
    assert any("records nothing" in note for note in summary.notes)


def test_cli_missing_dir_exits_2(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    with pytest.raises(SystemExit) as exc:
        trainer_main(["report", missing])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and missing in err


def _attempt(restart: int, world: int) -> Attempt:
    return Attempt(
        index=0, restart_count=restart, world_size=world, first_step=1, last_step=2, rows=2,
        start_s=0.0, end_s=1.0,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("prev", "nxt", "label"),
    [
        ((0, 2), (1, 2), "restart 1"),
        ((0, 2), (1, 1), "restart 1, world 2 -> 1"),
        ((1, 2), (1, 3), "membership change, world 2 -> 3"),  # a node joined: no restart used
        ((1, 3), (1, 3), "membership change"),
        ((2, 2), (0, 2), "relaunch"),
        ((2, 2), (0, 4), "relaunch, world 2 -> 4"),
    ],
)
def test_a_node_joining_is_a_membership_change_not_another_restart(prev, nxt, label):
    assert transition_label(_attempt(*prev), _attempt(*nxt)) == label
