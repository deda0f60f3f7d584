"""The elastic package's collectives, run for real: 2 processes on gloo over loopback.

One job of two worker processes exercises every collective path once (job-wide restart
count, preemption agreement, straggler monitor); the tests below assert on its output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

WORLD_SIZE = 2
WORKER_TIMEOUT_S = 60
REPO_ROOT = str(Path(__file__).resolve().parents[1])

WORKER = textwrap.dedent(
    """
    import datetime, json, sys
    import torch.distributed as dist
    from elastic.identity import RunIdentity, job_restart_count
    from elastic.preemption import agree_on_preemption, decide_emergency_save
    from elastic.straggler import StragglerMonitor

    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    out = {"rank": rank}
    out["restart"] = job_restart_count(RunIdentity.from_env())

    # Only rank 1 was signalled, and it cannot fit a save: everyone must exit unsaved.
    local = None if rank == 0 else decide_emergency_save(0.0, 25.0, 30.0, 10.0, 1.5)
    agreed = agree_on_preemption(local)
    out["agreed"] = None if agreed is None else agreed.save
    # Nobody signalled: no action anywhere.
    out["none"] = agree_on_preemption(None)
    # Rank 0 signalled and can save: everyone saves.
    local = decide_emergency_save(0.0, 1.0, 30.0, 2.0, 1.5) if rank == 0 else None
    agreed = agree_on_preemption(local)
    out["save"] = None if agreed is None else agreed.save

    monitor = StragglerMonitor(every_n=3, factor=1.5)
    times = [0.1, 0.1, 0.1] if rank == 0 else [0.5, 0.6, 0.7]
    out["reports"] = [monitor.record(t) for t in times]
    out["reports"] += [monitor.record(0.2) for _ in range(3)]
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)
    """
)


def run_gloo_workers(script: str, envs: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Start one process per entry of `envs` on a gloo group; return their RESULT JSON.

    The parent hosts the TCPStore on a free loopback port (port 0), so no port can be
    taken between choosing it and using it. Workers past the timeout are killed.
    """
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    world = len(envs)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), str(world), str(store.port)],
            env={**os.environ, "PYTHONPATH": REPO_ROOT, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, env in enumerate(envs)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=WORKER_TIMEOUT_S)
            assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{err}"
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert lines, f"worker printed no result:\n{out}\n{err}"
            results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    return sorted(results, key=lambda result: result["rank"])


@pytest.fixture(scope="module")
def two_rank_results() -> Iterator[list[dict[str, Any]]]:
    envs = [
        {"TORCHELASTIC_RESTART_COUNT": "0"},
        {"TORCHELASTIC_RESTART_COUNT": "2"},
    ]
    yield run_gloo_workers(WORKER, envs)


@pytest.mark.timeout(90)
def test_job_restart_count_is_max_over_ranks(two_rank_results: list[dict[str, Any]]) -> None:
    assert [result["restart"] for result in two_rank_results] == [2, 2]


@pytest.mark.timeout(90)
def test_preemption_agreement_is_the_same_on_every_rank(
    two_rank_results: list[dict[str, Any]],
) -> None:
    assert [result["agreed"] for result in two_rank_results] == [False, False]
    assert [result["none"] for result in two_rank_results] == [None, None]
    assert [result["save"] for result in two_rank_results] == [True, True]


@pytest.mark.timeout(90)
def test_straggler_monitor_reports_slow_rank_on_all_ranks(
    two_rank_results: list[dict[str, Any]],
) -> None:
    for result in two_rank_results:
        reports = result["reports"]
        assert reports[0] is None and reports[1] is None
        assert reports[3] is None and reports[4] is None
        slow = reports[2]
        assert slow["ranks"] == [0, 1]
        assert slow["step_times_s"] == pytest.approx([0.1, 0.6])
        assert slow["median_s"] == pytest.approx(0.35)
        assert slow["stragglers"] == [1]
        assert slow["window_steps"] == 3
        even = reports[5]
        assert even["step_times_s"] == pytest.approx([0.2, 0.2])
        assert even["stragglers"] == []
    assert two_rank_results[0]["reports"] == two_rank_results[1]["reports"]
