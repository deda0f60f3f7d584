"""elastic.RunRecorder: what each rank writes into the run directory."""

from __future__ import annotations

import json
import os
import threading

import pytest

from elastic.events import (
    EVENTS_FILE,
    METRICS_FILE,
    RANK_EVENTS_FILE,
    RunRecorder,
    rank_events_file,
)

pytestmark = pytest.mark.timeout(60)


def read_lines(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh.read().splitlines()]


def test_rank_0_writes_metrics_and_every_event(tmp_path):
    run_dir = str(tmp_path / "run")
    rec = RunRecorder(run_dir, rank=0)
    rec.metrics({"step": 1, "loss": 2.0})
    rec.event("start", 0, world_size=2)
    rec.event("fault", 1, every_rank=True, spec="kill:step=1")
    rec.event("fault", 2, rank=5)  # an explicit rank field is kept
    rec.close()
    rec.event("after_close", 3)  # ignored, no error
    assert sorted(os.listdir(run_dir)) == [EVENTS_FILE, METRICS_FILE]
    events = read_lines(os.path.join(run_dir, EVENTS_FILE))
    assert [(e["event"], e["step"], e["rank"]) for e in events] == [
        ("start", 0, 0),
        ("fault", 1, 0),
        ("fault", 2, 5),
    ]
    assert "every_rank" not in events[1] and events[1]["spec"] == "kill:step=1"
    assert events[0]["world_size"] == 2 and isinstance(events[0]["time"], float)
    assert [m["step"] for m in read_lines(os.path.join(run_dir, METRICS_FILE))] == [1]


def test_other_rank_writes_only_every_rank_events_to_its_own_file(tmp_path):
    run_dir = str(tmp_path / "run")
    rec = RunRecorder(run_dir, rank=1)
    assert not rec.is_main
    rec.metrics({"step": 1, "loss": 2.0})
    rec.event("start", 0)
    rec.event("checkpoint_saved", 1, bytes=10)
    rec.event("fault", 2, every_rank=True, spec="kill:rank=1")
    rec.event("failure", 2, every_rank=True, error="boom")
    rec.close()
    assert RANK_EVENTS_FILE.format(rank=1) == rank_events_file(1) == "events.rank1.jsonl"
    assert os.listdir(run_dir) == ["events.rank1.jsonl"]  # no metrics, no events.jsonl
    events = read_lines(os.path.join(run_dir, "events.rank1.jsonl"))
    assert [(e["event"], e["step"], e["rank"]) for e in events] == [
        ("fault", 2, 1),
        ("failure", 2, 1),
    ]
    # Appends: a second attempt of the same rank adds to the file.
    rec = RunRecorder(run_dir, rank=1)
    rec.event("fault", 7, every_rank=True)
    rec.close()
    assert len(read_lines(os.path.join(run_dir, "events.rank1.jsonl"))) == 3


def test_a_negative_rank_writes_nothing_and_rank_must_be_an_int(tmp_path):
    off_dir = str(tmp_path / "off")
    off = RunRecorder(off_dir, rank=-1)
    assert not off.enabled
    off.metrics({"step": 1})
    off.event("fault", 1, every_rank=True)
    off.close()
    assert not os.path.exists(off_dir)
    with pytest.raises(TypeError):
        RunRecorder(off_dir, rank=True)  # type: ignore[arg-type]


def test_empty_run_dir_writes_nothing():
    rec = RunRecorder("", rank=0)
    assert not rec.enabled
    rec.metrics({"step": 1})
    rec.event("fault", 1, every_rank=True)
    rec.close()


def test_concurrent_writers_do_not_tear_lines(tmp_path):
    run_dir = str(tmp_path / "run")
    rec = RunRecorder(run_dir, rank=2)
    threads = [
        threading.Thread(
            target=lambda t=t: [rec.event("tick", i, every_rank=True, t=t) for i in range(200)]
        )
        for t in range(4)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    rec.close()
    events = read_lines(os.path.join(run_dir, "events.rank2.jsonl"))
    assert len(events) == 800 and all(e["rank"] == 2 for e in events)
