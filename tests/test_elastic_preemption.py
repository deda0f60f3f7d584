"""Preemption: the save-or-exit rule, the grace period, and the signal handler.

Agreement across real ranks is exercised in test_elastic_collectives.py.
"""

from __future__ import annotations

import math
import os
import signal
import threading

import pytest

from elastic.preemption import (
    DEFAULT_GRACE_S,
    PreemptionDecision,
    PreemptionHandler,
    PreemptionHandlerError,
    agree_on_preemption,
    combine_preemption_votes,
    decide_emergency_save,
    grace_from_env,
)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("signal_time", "now", "grace_s", "expected_save_s", "factor", "save", "remaining"),
    [
        (100.0, 100.0, 30.0, 10.0, 1.5, True, 30.0),  # 15 s needed, 30 s left
        (100.0, 110.0, 30.0, 10.0, 1.5, True, 20.0),  # 15 of 20
        (100.0, 115.0, 30.0, 10.0, 1.5, True, 15.0),  # exactly fits
        (100.0, 116.0, 30.0, 10.0, 1.5, False, 14.0),  # 15 of 14
        (100.0, 100.0, 30.0, 25.0, 1.5, False, 30.0),  # slow save never fits
        (100.0, 100.0, 30.0, 25.0, 1.0, True, 30.0),  # no margin asked
        (100.0, 140.0, 30.0, 1.0, 1.5, False, -10.0),  # grace already over
        (100.0, 90.0, 30.0, 10.0, 1.5, True, 30.0),  # clock before signal: no time used
        (100.0, 100.0, 30.0, None, 1.5, False, 30.0),  # no estimate: rely on last commit
        (100.0, 100.0, 0.0, 0.0, 1.5, True, 0.0),
    ],
)
def test_decide_emergency_save(
    signal_time: float,
    now: float,
    grace_s: float,
    expected_save_s: float | None,
    factor: float,
    save: bool,
    remaining: float,
) -> None:
    decision = decide_emergency_save(signal_time, now, grace_s, expected_save_s, factor)
    assert decision.save is save
    assert decision.remaining_s == pytest.approx(remaining)
    if expected_save_s is None:
        assert decision.needed_s is None
    else:
        assert decision.needed_s == pytest.approx(expected_save_s * factor)
    assert decision.reason


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("grace_s", "expected_save_s", "factor", "named"),
    [
        (-1.0, 1.0, 1.5, "grace_s"),
        (math.nan, 1.0, 1.5, "grace_s"),
        (30.0, -1.0, 1.5, "expected_save_s"),
        (30.0, math.inf, 1.5, "expected_save_s"),
        (30.0, 1.0, 0.5, "safety_factor"),
    ],
)
def test_decide_rejects_bad_inputs(
    grace_s: float, expected_save_s: float, factor: float, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        decide_emergency_save(0.0, 0.0, grace_s, expected_save_s, factor)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, DEFAULT_GRACE_S),
        ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"}, 45.0),
        ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45", "PET_SHUTDOWN_TIMEOUT": "60"}, 60.0),
        (
            {
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45",
                "PET_SHUTDOWN_TIMEOUT": "60",
                "TRAINER_PREEMPTION_GRACE_S": "12.5",
            },
            12.5,
        ),
        ({"TRAINER_PREEMPTION_GRACE_S": " "}, DEFAULT_GRACE_S),
    ],
)
def test_grace_from_env_precedence(env: dict[str, str], expected: float) -> None:
    assert grace_from_env(env) == expected
    assert DEFAULT_GRACE_S == 30.0  # torchrun's default shutdown timeout


@pytest.mark.timeout(30)
@pytest.mark.parametrize("raw", ["soon", "-3", "nan"])
def test_grace_from_env_names_bad_variable(raw: str) -> None:
    with pytest.raises(ValueError, match="TRAINER_PREEMPTION_GRACE_S"):
        grace_from_env({"TRAINER_PREEMPTION_GRACE_S": raw})


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("requested", "cannot_save", "expected"),
    [
        (0, 0, (False, False)),
        (1, 0, (True, True)),
        (1, 1, (True, False)),
    ],
)
def test_combine_preemption_votes(
    requested: int, cannot_save: int, expected: tuple[bool, bool]
) -> None:
    assert combine_preemption_votes(requested, cannot_save) == expected


@pytest.mark.timeout(30)
def test_agree_without_process_group_keeps_local_decision() -> None:
    decision = decide_emergency_save(0.0, 0.0, 30.0, 1.0, 1.5)
    assert agree_on_preemption(decision) is decision
    assert agree_on_preemption(None) is None


@pytest.mark.timeout(30)
def test_handler_records_sigterm_and_restores_previous_handler() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        handler = PreemptionHandler(grace_s=30.0, safety_factor=1.5)
        assert not handler.requested
        with pytest.raises(PreemptionHandlerError):
            handler.decide(1.0)
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.requested
        assert handler.signal_name == "SIGTERM"
        assert seen == []  # ours replaced the previous handler
        decision = handler.decide(10.0, now=handler.signal_time + 20.0)
        assert isinstance(decision, PreemptionDecision)
        assert decision.save is False and decision.remaining_s == pytest.approx(10.0)
        assert handler.decide(2.0).save is True
        handler.close()
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]  # previous handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.timeout(30)
def test_handler_optional_sigint_and_first_signal_time_kept() -> None:
    # What was there before comes back: default_int_handler under a terminal, SIG_IGN
    # when the tests run as a background job (a shell starts those with SIGINT ignored).
    before = signal.getsignal(signal.SIGINT)
    with PreemptionHandler(grace_s=5.0, signals=(signal.SIGTERM, signal.SIGINT), env={}) as handler:
        os.kill(os.getpid(), signal.SIGINT)
        first = handler.signal_time
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.signal_name == "SIGINT"
        assert handler.signal_time == first
        assert handler.grace_s == 5.0
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.timeout(30)
def test_handler_grace_defaults_to_env() -> None:
    with PreemptionHandler(env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}) as handler:
        assert handler.grace_s == 7.0


@pytest.mark.timeout(30)
def test_handler_refuses_non_main_thread() -> None:
    errors: list[BaseException] = []

    def install() -> None:
        try:
            PreemptionHandler(grace_s=1.0)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join(timeout=10)
    assert len(errors) == 1
    assert isinstance(errors[0], PreemptionHandlerError)
    assert "main thread" in str(errors[0])


@pytest.mark.timeout(30)
def test_handler_refuses_uncatchable_signal_and_leaves_others_untouched() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(PreemptionHandlerError, match="SIGKILL"):
        PreemptionHandler(grace_s=1.0, signals=(signal.SIGTERM, signal.SIGKILL))
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.timeout(120)
def test_the_signal_tests_pass_when_launched_as_a_background_job() -> None:
    """A shell starts a background job (``bash scripts/test.sh &`` from a script) with SIGINT
    ignored: the tests compare with what was there before, not with a terminal's default."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         "-k", "not background_job"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=110,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout
