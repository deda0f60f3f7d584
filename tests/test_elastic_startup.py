"""A rank that dies during the start-up: its peers leave within the failure detector's bound.

Two real processes build a gloo group from ``MASTER_ADDR``/``MASTER_PORT`` (no torchrun, so
no agent stops the survivor for us): rank 1 is SIGKILLed at a start-up point (the fault
grammar's ``kill:at=POINT``), and rank 0 must leave on its own, within the peer timeout +
10 s, instead of waiting in ``init_process_group`` (120 s) or in the checkpoint manager's
group creation (600 s, ``CKPT_COLLECTIVE_TIMEOUT_S``) for a peer that will never come.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from elastic.heartbeat import PEER_SILENT_EXIT_CODE, STARTUP_GRACE_S
from testing.local_cluster import REPO
from testing.ports import free_port

PEER_TIMEOUT_S = 1.0
SLACK_S = 5.0
"""Process start, imports and a loaded machine, on top of a bound."""

SCRIPT = r"""
import json, logging, os, sys, tempfile, torch
import ckpt, elastic
from elastic.faults import fire_at_point

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
mode, peer_timeout_s = sys.argv[1], float(sys.argv[2])
setup_timeout_s = float(sys.argv[3]) if len(sys.argv) > 3 else None
ctx = elastic.init_distributed(timeout_s=120, peer_timeout_s=peer_timeout_s, heartbeat_s=0.3)
if mode == "leave":  # rank 0 leaves at once, rank 1 some peer timeouts later
    if ctx.rank == 1:
        import time; time.sleep(4 * peer_timeout_s)
    elastic.close_distributed()
    print(json.dumps({"rank": ctx.rank, "left": True}), flush=True)
    sys.exit(0)
fire_at_point("checkpoint_manager", ctx.rank, ctx.attempt)
manager = ckpt.CheckpointManager(tempfile.mkdtemp(), {"x": torch.zeros(2)},
                                 setup_timeout_s=setup_timeout_s)
with manager, elastic.RunGuard(saver=manager, peer_timeout_s=peer_timeout_s, heartbeat_s=0.2,
                               watchdog_s=0) as guard:
    detector = guard.heartbeat
    print(json.dumps({"rank": ctx.rank, "interval_s": detector.interval_s,
                      "startup_key": detector.key_prefix}), flush=True)
    manager.resume()
elastic.close_distributed()
"""


def two_ranks(tmp_path, *args: str, faults: str = "") -> list[tuple[int, str, float]]:
    """Run the script on ranks 0 and 1; (exit code, output, seconds from start to exit) each."""
    path = tmp_path / "startup_script.py"
    path.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "PET_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", PYTHONPATH=REPO, OMP_NUM_THREADS="1",
               TRAINER_FAULTS=faults)  # fmt: skip
    started = time.monotonic()
    logs = [tmp_path / f"rank{rank}.log" for rank in (0, 1)]
    procs = []
    for rank in (0, 1):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        with open(logs[rank], "w") as log:
            cmd = [sys.executable, str(path), *args]
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=rank_env, stdout=log, stderr=log))
    ended: dict[int, float] = {}
    try:
        while len(ended) < 2 and time.monotonic() - started < 60:
            for rank, proc in enumerate(procs):
                if rank not in ended and proc.poll() is not None:
                    ended[rank] = time.monotonic() - started
            time.sleep(0.02)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert len(ended) == 2, "a rank was still running after 60 s"
    return [(procs[r].returncode, logs[r].read_text(), ended[r]) for r in (0, 1)]


@pytest.mark.timeout(90)
def test_a_rank_killed_before_the_group_exists_ends_its_peer_at_the_startup_bound(tmp_path):
    (code, text, took), (killed, _, died) = two_ranks(
        tmp_path, "run", str(PEER_TIMEOUT_S), faults="kill:at=init_process_group:rank=1"
    )
    assert killed == -9
    assert code not in (0, -9), text[-3000:]
    bound = PEER_TIMEOUT_S + STARTUP_GRACE_S
    waited = took - died
    print(f"survivor left {waited:.1f} s after the kill (bound {bound} s)")
    assert waited < bound + SLACK_S, text[-3000:]  # init_process_group's own timeout: 120 s


@pytest.mark.timeout(90)
def test_a_rank_killed_before_the_checkpoint_group_is_caught_by_the_startup_detector(tmp_path):
    (code, text, took), (killed, _, died) = two_ranks(
        tmp_path, "run", str(PEER_TIMEOUT_S), faults="kill:at=checkpoint_manager:rank=1"
    )
    assert killed == -9
    assert code == PEER_SILENT_EXIT_CODE, text[-3000:]
    assert "rank 0: peer failure detected: rank 1" in text, text[-3000:]
    waited = took - died
    print(f"survivor left {waited:.1f} s after the kill (peer timeout {PEER_TIMEOUT_S} s)")
    assert waited < PEER_TIMEOUT_S + STARTUP_GRACE_S + SLACK_S, text[-3000:]  # 600 s before


@pytest.mark.timeout(90)
def test_with_the_detector_off_the_checkpoint_groups_setup_timeout_bounds_the_wait(tmp_path):
    (code, text, took), (killed, _, died) = two_ranks(
        tmp_path, "run", "0", "3", faults="kill:at=checkpoint_manager:rank=1"
    )
    assert killed == -9
    assert code == 1 and "timeout" in text.lower(), text[-3000:]
    assert took - died < 3 + SLACK_S, text[-3000:]


@pytest.mark.timeout(90)
def test_the_guard_takes_the_startup_detector_over_with_its_settings(tmp_path):
    results = two_ranks(tmp_path, "run", str(PEER_TIMEOUT_S))
    said = []
    for code, text, _ in results:
        assert code == 0, text[-3000:]
        said += [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert sorted(s["rank"] for s in said) == [0, 1]
    for s in said:
        assert s["interval_s"] == 0.2  # the guard's, not init_distributed's 0.3
        assert s["startup_key"].endswith("/0/2")  # the same keys: attempt 0 of a world of 2
    text = "".join(t for _, t, _ in results)
    # init_distributed started one detector per rank; the guard took it over, none other
    assert text.count("peer heartbeat every 0.3s") == 2 and "every 0.2s" not in text, text


@pytest.mark.timeout(90)
def test_a_rank_that_closed_its_group_is_not_taken_for_silent(tmp_path):
    """Rank 0 (the store's host) closes and exits while rank 1 runs 4 peer timeouts longer:
    the start-up detector said it left, so rank 1 finishes."""
    results = two_ranks(tmp_path, "leave", str(PEER_TIMEOUT_S))
    for code, text, _ in results:
        assert code == 0, text[-3000:]
        assert "peer failure detected" not in text


@pytest.mark.timeout(90)
def test_the_store_hosts_death_during_the_startup_ends_its_peer_at_once(tmp_path):
    """Rank 0 hosts the group's store: its death fails rank 1's wait for it right away."""
    (killed, _, died), (code, text, took) = two_ranks(
        tmp_path, "run", str(PEER_TIMEOUT_S), faults="kill:at=checkpoint_manager:rank=0"
    )
    assert killed == -9
    assert code not in (0, -9), text[-3000:]
    assert took - died < PEER_TIMEOUT_S + STARTUP_GRACE_S + SLACK_S, text[-3000:]
