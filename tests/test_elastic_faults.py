"""Fault injection: the spec grammar, when faults fire, and what they do to a process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from elastic import faults as faults_module
from elastic.faults import (
    ENV_FAULTS,
    PROCESS_ACTIONS,
    SAVER_ACTIONS,
    FaultKind,
    FaultPlan,
    FaultSpec,
    InjectedFault,
    parse_fault_spec,
    unhandled_kinds,
)

PROCESS_TIMEOUT_S = 30
# Children import this checkout's `elastic`, whatever their working directory.
CHILD_ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("kill:step=5", FaultSpec(kind=FaultKind.KILL, step=5)),
        ("exit:step=0:rank=2", FaultSpec(kind=FaultKind.EXIT, step=0, rank=2)),
        ("raise:step=7:attempt=1", FaultSpec(kind=FaultKind.RAISE, step=7, attempt=1)),
        (
            "hang:attempt=2:rank=1:step=9",
            FaultSpec(kind=FaultKind.HANG, step=9, rank=1, attempt=2),
        ),
        ("sigterm:step=3", FaultSpec(kind=FaultKind.SIGTERM, step=3)),
        ("ckpt-storage:step=10:rank=0", FaultSpec(kind=FaultKind.CKPT_STORAGE, step=10, rank=0)),
        ("nan:step=25:rank=1", FaultSpec(kind=FaultKind.NAN, step=25, rank=1)),
        ("  kill : step = 4 ", FaultSpec(kind=FaultKind.KILL, step=4)),
        (
            "kill:at=checkpoint_manager:rank=1",
            FaultSpec(kind=FaultKind.KILL, at="checkpoint_manager", rank=1),
        ),
        (
            "hang:at=init_process_group:attempt=2",
            FaultSpec(kind=FaultKind.HANG, at="init_process_group", attempt=2),
        ),
    ],
)
def test_parse_valid_specs(text: str, expected: FaultSpec) -> None:
    assert parse_fault_spec(text) == expected


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "unknown kind"),
        ("explode:step=1", "unknown kind 'explode'"),
        ("KILL:step=1", "unknown kind"),
        ("kill", "step is required"),
        ("kill:rank=1", "step is required"),
        ("kill:step", "not key=value"),
        ("kill:step=-1", "not a non-negative integer"),
        ("kill:step=1.5", "not a non-negative integer"),
        ("kill:step=", "not a non-negative integer"),
        ("kill:step=1:node=3", "unknown key 'node'"),
        ("kill:step=1:step=2", "given twice"),
        ("kill:step=1:rank=x", "not a non-negative integer"),
        ("kill:at=backward", "at='backward' is not one of init_process_group, checkpoint_manager"),
        ("kill:step=1:at=resume", "step is required (or at=POINT instead"),
        ("ckpt-storage:at=resume", "ckpt-storage needs step=S"),
    ],
)
def test_parse_invalid_specs_say_what_is_wrong(text: str, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_fault_spec(text)
    message = str(info.value)
    assert repr(text) in message
    assert reason in message
    for kind in ("kill", "exit", "raise", "hang", "sigterm", "ckpt-storage", "nan"):
        assert kind in message
    for key in ("step", "rank", "attempt"):
        assert key in message


@pytest.mark.timeout(30)
def test_spec_text_round_trips() -> None:
    spec = FaultSpec(kind=FaultKind.CKPT_STORAGE, step=3, rank=1, attempt=2)
    assert parse_fault_spec(str(spec)) == spec
    at = FaultSpec(kind=FaultKind.KILL, at="resume", rank=1)
    assert str(at) == "kill:at=resume:rank=1:attempt=0"
    assert parse_fault_spec(str(at)) == at


@pytest.mark.timeout(30)
def test_a_fault_at_a_startup_point_fires_there_only_once_and_never_at_a_step() -> None:
    plan = FaultPlan.from_args_and_env(["raise:at=resume:rank=1", "raise:step=0"], env={})
    plan.fire_at("checkpoint_manager", 1, 0)  # another point: nothing
    plan.fire_at("resume", 0, 0)  # another rank: nothing
    assert [s.step for s in plan.due(0, 1, 0)] == [0]  # step 0 is the step fault only
    fired = []
    with pytest.raises(InjectedFault, match="raise:at=resume:rank=1"):
        plan.fire_at("resume", 1, 0, on_fire=fired.append)
    assert [str(s) for s in fired] == ["raise:at=resume:rank=1:attempt=0"]
    plan.fire_at("resume", 1, 0)  # once per process
    with pytest.raises(ValueError, match="not a start-up point"):
        plan.fire_at("forward", 1, 0)
    with pytest.raises(ValueError, match="needs a step or a start-up point"):
        FaultSpec(kind=FaultKind.KILL)


@pytest.mark.timeout(30)
def test_plan_combines_args_then_env() -> None:
    env = {ENV_FAULTS: "exit:step=2;; hang:step=3:rank=1 ;"}
    plan = FaultPlan.from_args_and_env(["kill:step=1", "raise:step=4"], env=env)
    assert [str(spec.kind.value) for spec in plan.specs] == ["kill", "raise", "exit", "hang"]
    assert plan.specs[3].rank == 1


@pytest.mark.timeout(30)
def test_plan_reads_os_environ_and_reports_bad_env_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_FAULTS, "raise:step=2")
    assert FaultPlan.from_args_and_env([]).specs == (FaultSpec(kind=FaultKind.RAISE, step=2),)
    monkeypatch.setenv(ENV_FAULTS, "raise:step=2;oops:step=1")
    with pytest.raises(ValueError, match="oops"):
        FaultPlan.from_args_and_env([])
    assert not FaultPlan.from_args_and_env([], env={})


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("spec", "step", "rank", "attempt", "fires"),
    [
        ("raise:step=5", 5, 0, 0, True),
        ("raise:step=5", 5, 3, 0, True),  # no rank: every rank
        ("raise:step=5", 4, 0, 0, False),
        ("raise:step=5", 6, 0, 0, False),  # exact step only
        ("raise:step=5", 5, 0, 1, False),  # default attempt is 0
        ("raise:step=5:rank=1", 5, 0, 0, False),
        ("raise:step=5:rank=1", 5, 1, 0, True),
        ("raise:step=5:attempt=2", 5, 0, 2, True),
        ("raise:step=5:attempt=2", 5, 0, 1, False),
        ("ckpt-storage:step=5", 5, 0, 0, False),  # never fired by fire()
    ],
)
def test_fire_matches_step_rank_and_attempt(
    spec: str, step: int, rank: int, attempt: int, fires: bool
) -> None:
    plan = FaultPlan([parse_fault_spec(spec)])
    seen: list[FaultSpec] = []
    if fires:
        with pytest.raises(InjectedFault) as info:
            plan.fire(step, rank, attempt, on_fire=seen.append)
        assert info.value.step == step and info.value.rank == rank
        assert seen == [parse_fault_spec(spec)]  # on_fire ran before the action
    else:
        plan.fire(step, rank, attempt, on_fire=seen.append)
        assert seen == []


@pytest.mark.timeout(30)
def test_every_fault_kind_has_exactly_one_handler() -> None:
    assert unhandled_kinds() == []
    assert set(PROCESS_ACTIONS) | set(SAVER_ACTIONS) == set(FaultKind)


@pytest.mark.timeout(30)
def test_a_kind_missing_from_the_tables_is_found_and_refused_when_fired(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        faults_module,
        "PROCESS_ACTIONS",
        {k: v for k, v in PROCESS_ACTIONS.items() if k is not FaultKind.HANG},
    )
    assert unhandled_kinds() == [FaultKind.HANG]
    plan = FaultPlan([parse_fault_spec("hang:step=2")])
    with pytest.raises(ValueError, match="not a process fault"):
        plan.fire(2, rank=0, attempt=0)


@pytest.mark.timeout(30)
def test_saver_faults_reach_the_saver_through_their_table_entry() -> None:
    calls: list[tuple[str, object]] = []

    class Saver:
        def inject_storage_fault(self, spec: str) -> None:
            calls.append(("storage", spec))

        def inject_non_finite(self) -> list[str]:
            calls.append(("nan", None))
            return []

    plan = FaultPlan(
        [parse_fault_spec("nan:step=3"), parse_fault_spec("ckpt-storage:step=1:phase=manifest")]
    )
    assert plan.saver_faults_due(2, rank=0, attempt=0) == [plan.specs[1]]
    due = plan.saver_faults_due(3, rank=0, attempt=0)
    assert due == [plan.specs[0]]
    for spec in [plan.specs[1], *due]:
        SAVER_ACTIONS[spec.kind](Saver(), spec)
    assert calls == [("storage", "ckpt-storage:phase=manifest"), ("nan", None)]


@pytest.mark.timeout(30)
def test_fault_fires_once_per_process() -> None:
    plan = FaultPlan([parse_fault_spec("raise:step=2"), parse_fault_spec("raise:step=2")])
    with pytest.raises(InjectedFault):
        plan.fire(2, 0, 0)
    with pytest.raises(InjectedFault):
        plan.fire(2, 0, 0)  # the identical second spec is its own fault
    plan.fire(2, 0, 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("spec", "calls", "expected"),
    [
        # (step, rank, attempt) per save -> whether that save's writes must fail
        ("ckpt-storage:step=10", [(5, 0, 0), (10, 0, 0), (15, 0, 0)], [False, True, False]),
        ("ckpt-storage:step=10", [(12, 0, 0), (14, 0, 0)], [True, False]),  # next save after
        ("ckpt-storage:step=10:rank=1", [(10, 0, 0), (10, 1, 0)], [False, True]),
        ("ckpt-storage:step=10:attempt=1", [(10, 0, 0), (20, 0, 1)], [False, True]),
        ("kill:step=10", [(10, 0, 0)], [False]),
    ],
)
def test_storage_fault_due(
    spec: str, calls: list[tuple[int, int, int]], expected: list[bool]
) -> None:
    plan = FaultPlan([parse_fault_spec(spec)])
    assert [plan.storage_fault_due(*call) for call in calls] == expected


def _run_fault(spec: str, tmp_path: Path, extra: str = "") -> subprocess.CompletedProcess[str]:
    """Run a child that fires `spec` at step 3 and then prints 'survived'."""
    code = textwrap.dedent(
        f"""
        import sys
        from elastic.faults import FaultPlan
        {extra}
        plan = FaultPlan.from_args_and_env([{spec!r}], env={{}})
        for step in range(5):
            plan.fire(step, rank=0, attempt=0,
                      on_fire=lambda s: print("fired", s, flush=True))
        print("survived", flush=True)
        """
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
        cwd=tmp_path,
        env=CHILD_ENV,
    )


@pytest.mark.timeout(60)
def test_kill_fault_sigkills_the_process(tmp_path: Path) -> None:
    result = _run_fault("kill:step=3", tmp_path)
    assert result.returncode == -signal.SIGKILL
    assert "fired kill:step=3" in result.stdout
    assert "survived" not in result.stdout


@pytest.mark.timeout(60)
def test_exit_fault_exits_with_code_1_after_flushing_logs(tmp_path: Path) -> None:
    extra = "import logging; logging.basicConfig(stream=sys.stderr, level=logging.WARNING)"
    result = _run_fault("exit:step=3", tmp_path, extra)
    assert result.returncode == 1
    assert "survived" not in result.stdout
    assert "injecting fault exit:step=3" in result.stderr


@pytest.mark.timeout(60)
def test_other_rank_or_attempt_survives(tmp_path: Path) -> None:
    assert _run_fault("exit:step=3:rank=1", tmp_path).stdout.endswith("survived\n")
    assert _run_fault("exit:step=3:attempt=1", tmp_path).returncode == 0


@pytest.mark.timeout(60)
def test_sigterm_fault_without_handler_terminates(tmp_path: Path) -> None:
    result = _run_fault("sigterm:step=3", tmp_path)
    assert result.returncode == -signal.SIGTERM
    assert "survived" not in result.stdout


@pytest.mark.timeout(60)
def test_sigterm_fault_reaches_preemption_handler(tmp_path: Path) -> None:
    extra = textwrap.dedent(
        """
        from elastic.preemption import PreemptionHandler
        handler = PreemptionHandler(grace_s=30)
        import atexit
        atexit.register(lambda: print("requested", handler.signal_name, flush=True))
        """
    ).replace("\n", "\n        ")
    result = _run_fault("sigterm:step=3", tmp_path, extra)
    assert result.returncode == 0, result.stderr
    assert "survived" in result.stdout
    assert "requested SIGTERM" in result.stdout


@pytest.mark.timeout(60)
def test_hang_fault_stops_progress_without_holding_the_gil(tmp_path: Path) -> None:
    # A thread keeps printing while the main thread hangs: the GIL is free.
    code = textwrap.dedent(
        """
        import sys, threading, time
        from elastic.faults import FaultPlan
        def say(text):
            sys.stdout.write(text + "\\n")  # one write: lines from two threads stay whole
            sys.stdout.flush()
        def ticker():
            while True:
                say("tick")
                time.sleep(0.05)
        plan = FaultPlan.from_args_and_env(["hang:step=1"], env={})
        threading.Thread(target=ticker, daemon=True).start()
        for step in range(3):
            plan.fire(step, rank=0, attempt=0, on_fire=lambda s: say("hanging"))
        print("survived", flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=CHILD_ENV,
    )
    try:
        deadline = time.monotonic() + PROCESS_TIMEOUT_S
        assert proc.stdout is not None
        while "hanging" not in proc.stdout.readline():
            assert time.monotonic() < deadline and proc.poll() is None, "fault never fired"
        time.sleep(1.5)
        assert proc.poll() is None, "a hang fault must not end the process"
    finally:
        proc.kill()
        out, _ = proc.communicate(timeout=PROCESS_TIMEOUT_S)
    assert "survived" not in out
    # About 30 ticks in 1.5 s while the main thread hangs; a held GIL would give ~0.
    assert out.count("tick") >= 10
