"""Watchdog: a process that stops beating is dumped and ended; one that beats is not."""

from __future__ import annotations

import datetime
import glob
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from elastic.watchdog import Watchdog, process_group_timeout

PROCESS_TIMEOUT_S = 30
STALL_EXIT_CODE = 42
REPO_ROOT = str(Path(__file__).resolve().parents[1])


def _run_child(body: str, dump_dir: Path) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(
        """
        import sys, time
        from elastic.watchdog import Watchdog
        dump_dir = sys.argv[1]
        """
    ) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code, str(dump_dir)],
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
        cwd=dump_dir.parent,
        env={**os.environ, "PYTHONPATH": REPO_ROOT, "RANK": "3", "WORLD_SIZE": "4"},
    )


@pytest.mark.timeout(60)
def test_stalled_process_dumps_stacks_and_exits(tmp_path: Path) -> None:
    dump_dir = tmp_path / "dumps"
    body = f"""
    import logging
    logging.basicConfig(level=logging.ERROR)
    def on_stall(info):
        print("on_stall", info.step, info.rank, info.dump_path, flush=True)
    watchdog = Watchdog(1.0, dump_dir, exit_code={STALL_EXIT_CODE}, on_stall=on_stall)
    for step in range(5):
        time.sleep(0.05)
        watchdog.beat(step)
    def stalled_inside_data_loader():
        time.sleep(60)
    stalled_inside_data_loader()
    print("not reached", flush=True)
    """
    started = time.monotonic()
    result = _run_child(body, dump_dir)
    elapsed = time.monotonic() - started
    assert result.returncode == STALL_EXIT_CODE, result.stderr
    # Detected about 1 s after the last beat; the stalled call would sleep 60 s.
    assert elapsed < 20
    assert "not reached" not in result.stdout
    dumps = glob.glob(str(dump_dir / "stacks_rank3_pid*_*.txt"))
    assert len(dumps) == 1
    text = Path(dumps[0]).read_text()
    assert "stalled_inside_data_loader" in text
    assert "after step 4" in text
    assert f"on_stall 4 3 {dumps[0]}" in result.stdout
    assert "step 4" in result.stderr and dumps[0] in result.stderr


@pytest.mark.timeout(60)
def test_beating_and_allowed_phases_do_not_trip(tmp_path: Path) -> None:
    body = f"""
    # Each long sleep (2.5 s) outlasts the timeout plus a poll (1.5 + 0.375 s), so it
    # trips if its exemption is broken; the short ones marked stay far (7x+) below it.
    watchdog = Watchdog(1.5, dump_dir, exit_code={STALL_EXIT_CODE})
    for step in range(10):
        time.sleep(0.1)  # short: beating
        watchdog.beat(step)
    with watchdog.allow(5.0):
        time.sleep(2.5)  # e.g. first step or checkpoint load
    time.sleep(0.2)  # short: the usual timeout restarts when the allowance ends
    with watchdog.paused():
        time.sleep(2.5)
    time.sleep(0.2)  # short
    watchdog.close()
    time.sleep(2.5)  # closed: no stall detection at all
    print("finished", flush=True)
    """
    result = _run_child(body, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "finished" in result.stdout
    assert not glob.glob(str(tmp_path / "stacks_*.txt"))


@pytest.mark.timeout(60)
def test_allowance_is_bounded(tmp_path: Path) -> None:
    body = f"""
    def on_stall(info):
        print("stalled_after", time.monotonic() - entered, flush=True)
    watchdog = Watchdog(0.3, dump_dir, exit_code={STALL_EXIT_CODE}, on_stall=on_stall)
    def slow_checkpoint_load():
        with watchdog.allow(1.0):
            time.sleep(60)
    entered = time.monotonic()
    slow_checkpoint_load()
    """
    result = _run_child(body, tmp_path)
    assert result.returncode == STALL_EXIT_CODE, result.stderr
    # Measured in the child from just before allow(): not before the allowance ran out
    # (the 0.3 s timeout alone would trip at ~0.4 s), and long before the 60 s sleep.
    [line] = [x for x in result.stdout.splitlines() if x.startswith("stalled_after ")]
    assert 1.0 <= float(line.split()[1]) < 15, line
    (dump,) = glob.glob(str(tmp_path / "stacks_rank3_*.txt"))
    assert "slow_checkpoint_load" in Path(dump).read_text()


@pytest.mark.timeout(60)
def test_watchdog_catches_injected_hang(tmp_path: Path) -> None:
    body = f"""
    from elastic.faults import FaultPlan
    watchdog = Watchdog(1.0, dump_dir, exit_code={STALL_EXIT_CODE})
    plan = FaultPlan.from_args_and_env(["hang:step=2"], env={{}})
    for step in range(5):
        plan.fire(step, rank=3, attempt=0)
        watchdog.beat(step)
    """
    result = _run_child(body, tmp_path)
    assert result.returncode == STALL_EXIT_CODE
    (dump,) = glob.glob(str(tmp_path / "stacks_rank3_*.txt"))
    text = Path(dump).read_text()
    assert "_hang_forever" in text and "after step 1" in text


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"timeout_s": 0.0}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"timeout_s": 1.0, "exit_code": 300}, "exit_code"),
    ],
)
def test_watchdog_rejects_bad_settings(
    tmp_path: Path, kwargs: dict[str, float], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        Watchdog(dump_dir=str(tmp_path), rank=0, **kwargs)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_watchdog_in_process_close_stops_thread(tmp_path: Path) -> None:
    watchdog = Watchdog(60.0, str(tmp_path), rank=0)
    assert watchdog.running
    watchdog.beat(1)
    watchdog.close()
    watchdog.close()
    assert not watchdog.running


@pytest.mark.timeout(30)
def test_process_group_timeout() -> None:
    assert process_group_timeout() == datetime.timedelta(seconds=120)
    assert process_group_timeout(30) == datetime.timedelta(seconds=30)
    with pytest.raises(ValueError, match="collective timeout"):
        process_group_timeout(0)


# -- the "auto" bound: derived from measured step times (elastic/guard.py) -------------------


@pytest.mark.parametrize(
    ("step_times", "expected"),
    [
        ([], 600.0),  # nothing measured yet: the cap
        ([0.1, 0.1, 0.1, 0.1, 0.1], 60.0),  # fast steps: the floor
        ([8.0, 9.0, 10.0, 11.0, 100.0], 100.0),  # 10 x the median; one slow step (a save) ignored
        ([30.0, 31.0, 29.0], 300.0),
        ([90.0, 90.0, 90.0], 600.0),  # capped
        ([5.0, 7.0], 60.0),  # even count: mean of the middle two (6 s -> 60 s)
        ([7.0, 9.0], 80.0),
    ],
)
def test_auto_watchdog_bound_table(step_times: list[float], expected: float) -> None:
    from elastic.guard import auto_watchdog_s

    assert auto_watchdog_s(step_times) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("auto", None), ("AUTO", None), (0, 0.0), (0.0, 0.0), (15, 15.0), ("300", 300.0)],
)
def test_parse_watchdog_s(value: float | str, expected: float | None) -> None:
    from elastic.guard import parse_watchdog_s

    assert parse_watchdog_s(value) == expected


@pytest.mark.parametrize("value", ["soon", -1.0, float("nan"), True])
def test_parse_watchdog_s_rejects(value: float | str) -> None:
    from elastic.guard import parse_watchdog_s

    with pytest.raises(ValueError, match="watchdog_s"):
        parse_watchdog_s(value)


@pytest.mark.timeout(30)
def test_set_timeout_changes_the_bound(tmp_path: Path) -> None:
    watchdog = Watchdog(600.0, str(tmp_path), rank=0)
    try:
        watchdog.set_timeout(60.0)
        assert watchdog.timeout_s == 60.0
        with pytest.raises(ValueError, match="timeout_s"):
            watchdog.set_timeout(0)
    finally:
        watchdog.close()


@pytest.mark.timeout(30)
def test_run_guard_watchdog_is_on_by_default_and_derives_its_bound(tmp_path: Path) -> None:
    from elastic.guard import AUTO_WATCHDOG_MAX_S, AUTO_WATCHDOG_MIN_S, RunGuard

    with RunGuard(dump_dir=str(tmp_path), env={}) as guard:
        assert guard.watchdog is not None and guard.watchdog_auto
        assert guard.watchdog.timeout_s == AUTO_WATCHDOG_MAX_S  # until steps are timed
        assert guard.heartbeat is None  # no process group: nothing to watch
        for step in guard.steps(0, 6):
            time.sleep(0.01)
            # The first step and the next four are timed: the bound is set at step 6.
            expected = AUTO_WATCHDOG_MAX_S if step < 6 else None
            if expected is not None:
                assert guard.watchdog.timeout_s == expected
        assert guard.watchdog.timeout_s == AUTO_WATCHDOG_MIN_S  # 10 x 0.01 s, floored
    with RunGuard(dump_dir=str(tmp_path), env={}, watchdog_s=0) as guard:
        assert guard.watchdog is None
    with RunGuard(dump_dir=str(tmp_path), env={}, watchdog_s=15) as guard:
        assert guard.watchdog is not None and guard.watchdog.timeout_s == 15.0
        for _ in guard.steps(0, 7):
            pass
        assert guard.watchdog.timeout_s == 15.0  # an explicit bound is kept


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (None, "auto"),
        ("run.watchdog_s=auto", "auto"),
        ("run.watchdog_s=15", 15.0),
        ("run.watchdog_s=0", 0.0),
    ],
)
def test_trainer_config_watchdog_defaults_to_auto(override: str | None, expected) -> None:
    from trainer.config import load_config

    cfg = load_config(None, [override] if override else [])
    assert cfg.run.watchdog_s == expected


@pytest.mark.parametrize("value", ["-1", "soon"])
def test_trainer_config_rejects_a_bad_watchdog(value: str) -> None:
    from trainer.config import load_config

    with pytest.raises(ValueError, match=r"run\.watchdog_s"):
        load_config(None, [f"run.watchdog_s={value}"])
