"""The divergence guard: a loss that is not finite stops the run or rolls it back.

A NaN loss at step 25 used to train on NaN to the end and exit 0. ``RunGuard.check(loss)``
applies the policy: ``stop`` (exit code 3, naming the step and the last checkpoint) or
``rollback`` (the newest checkpoint restored on every rank, the next global batches
skipped through the sampler, bounded by ``max_rollbacks``). The decisions are pure and
tested as tables; the guard is tested with a stand-in saver, and across 2 gloo ranks for
the agreement when only one rank sees the NaN.
"""

from __future__ import annotations

import pytest

import elastic
from elastic import divergence as div
from elastic.errors import DIVERGED_EXIT_CODE, Diverged
from elastic.faults import FaultKind, FaultPlan, parse_fault_spec
from testing.spawn import run_ok

pytestmark = pytest.mark.timeout(60)

NAN = float("nan")


@pytest.mark.parametrize(
    ("policy", "done", "last", "expected"),
    [
        (div.DivergencePolicy(), 0, 8, div.STOP),
        (div.DivergencePolicy(action=div.ROLLBACK), 0, 8, div.ROLLBACK),
        (div.DivergencePolicy(action=div.ROLLBACK), 0, None, div.STOP),  # nothing to restore
        (div.DivergencePolicy(action=div.ROLLBACK, max_rollbacks=2), 1, 8, div.ROLLBACK),
        (div.DivergencePolicy(action=div.ROLLBACK, max_rollbacks=2), 2, 8, div.STOP),
        (div.DivergencePolicy(action=div.ROLLBACK, max_rollbacks=0), 0, 8, div.STOP),
    ],
)
def test_what_a_divergence_does(policy, done, last, expected):
    assert div.decide(policy, done, last)[0] == expected


@pytest.mark.parametrize(
    ("skip", "diverged", "restored", "expected"),
    [(None, 10, 8, 2), (None, 9, 8, 1), (None, 8, 8, 1), (3, 10, 8, 3), (0, 10, 8, 0)],
)
def test_how_many_batches_a_rollback_skips(skip, diverged, restored, expected):
    policy = div.DivergencePolicy(action=div.ROLLBACK, skip=skip)
    assert div.batches_to_skip(policy, diverged, restored) == expected


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("explode",), "divergence must be one of stop, rollback"),
        (("rollback", "some"), "rollback_skip must be 'auto'"),
        (("rollback", -1), "rollback_skip must be 'auto'"),
        (("rollback", 2, -1), "max_rollbacks must be an int >= 0"),
    ],
)
def test_bad_policies_are_refused_naming_the_setting(args, match):
    with pytest.raises(ValueError, match=match):
        div.DivergencePolicy.of(*args)


class _Sampler:
    def __init__(self, global_batch: int = 4) -> None:
        self.global_batch = global_batch
        self.cursor = 0

    def advance(self) -> None:
        self.cursor += self.global_batch


class _Saver:
    """A checkpoint manager stand-in: checkpoints at ``committed``, resume restores the newest."""

    def __init__(self, committed: list[int], sampler: _Sampler | None = None) -> None:
        self.committed = committed
        self.sampler = sampler
        self.calls: list[str] = []
        self.poisoned = 0

    def expected_save_s(self) -> float:
        return 0.1

    def emergency_save(self, step: int) -> bool:
        return True

    def inject_storage_fault(self, spec: str) -> None:
        pass

    def inject_non_finite(self) -> list[str]:
        self.poisoned += 1
        return ["model.weight"]

    def wait(self) -> str | None:
        self.calls.append("wait")
        return f"/ckpt/checkpoint_{self.last_committed_step:07d}" if self.committed else None

    @property
    def last_committed_step(self) -> int | None:
        return max(self.committed) if self.committed else None

    def resume(self) -> int | None:
        self.calls.append("resume")
        if self.sampler is not None:  # the data position comes back with the checkpoint
            self.sampler.cursor = self.last_committed_step * self.sampler.global_batch
        return self.last_committed_step


def _guard(saver, sampler=None, events=None, **kw) -> elastic.RunGuard:
    def on_event(name, step, **fields):
        if events is not None:
            events.append((name, step, fields))

    return elastic.RunGuard(
        saver=saver, sampler=sampler, on_event=on_event, watchdog_s=0, peer_timeout_s=0,
        attempt=0, rank=0, env={}, **kw,
    )  # fmt: skip


def test_a_finite_loss_changes_nothing():
    saver = _Saver([4])
    with _guard(saver) as guard:
        assert [s for s in guard.steps(0, 3) if not guard.check(1.5)] == [1, 2, 3]
    assert saver.calls == []


@pytest.mark.parametrize("loss", [NAN, float("inf"), float("-inf")])
def test_stop_exits_3_naming_the_step_and_the_last_checkpoint(loss):
    saver, events = _Saver([4, 8]), []
    with pytest.raises(Diverged) as err, _guard(saver, events=events) as guard:
        for step in guard.steps(0, 20):
            guard.check(loss if step == 10 else 1.0)
    assert err.value.code == DIVERGED_EXIT_CODE == 3 and err.value.step == 10
    message = str(err.value)
    assert "step 10" in message and "last checkpoint is step 8" in message
    assert "/ckpt/checkpoint_0000008" in message and "run.divergence=rollback" in message
    assert saver.calls == ["wait"]  # drained the save in flight, restored nothing
    assert [(n, s, f["policy"], f["action"], f["last_checkpoint_step"]) for n, s, f in events] == [
        ("diverged", 10, "stop", "stop", 8)
    ]


def test_rollback_restores_skips_k_batches_and_goes_on_after_the_restored_step():
    sampler, events = _Sampler(), []
    saver = _Saver([4, 8], sampler)
    trained: list[tuple[int, int]] = []
    with _guard(saver, sampler, events, divergence="rollback", rollback_skip=3) as guard:
        for step in guard.steps(0, 12):
            loss = NAN if step == 10 and guard.rollbacks == 0 else 1.0
            if guard.check(loss):
                continue
            trained.append((step, sampler.cursor // 4))  # step, global batch index
            sampler.advance()
    # steps 1..9 took batches 0..8; step 10 diverged; back at step 8 (batch 8 next), 3
    # batches (8, 9, 10) skipped: steps 9..12 take batches 11..14
    assert trained == [(s, s - 1) for s in range(1, 10)] + [(s, s + 2) for s in range(9, 13)]
    assert saver.calls == ["wait", "resume"]
    assert [f["action"] for n, _, f in events if n == "diverged"] == ["rollback"]
    rollback = next(f for n, _, f in events if n == "rolled_back")
    assert rollback["from_step"] == 10 and rollback["to_step"] == 8
    assert rollback["skipped_batches"] == 3 and rollback["rollbacks"] == 1
    assert guard.rollbacks == 1


def test_rollback_is_bounded_then_stops():
    saver, sampler = _Saver([2]), _Sampler()
    with (
        pytest.raises(Diverged, match="already rolled back 2 time"),
        _guard(saver, sampler, divergence="rollback", max_rollbacks=2) as guard,
    ):
        for _ in guard.steps(0, 50):
            guard.check(NAN)  # diverges every time
    assert saver.calls.count("resume") == 2


def test_rollback_needs_a_saver_that_resumes_and_a_sampler():
    with pytest.raises(ValueError, match="needs sampler="):
        _guard(_Saver([1]), None, divergence="rollback")
    with pytest.raises(ValueError, match="saver that can resume"):
        elastic.RunGuard(divergence="rollback", sampler=_Sampler(), env={}, rank=0, attempt=0)


def test_the_nan_fault_has_the_saver_poison_the_state_at_its_step_once():
    saver, events = _Saver([]), []
    assert parse_fault_spec("nan:step=3").kind is FaultKind.NAN
    with _guard(saver, events=events, faults=["nan:step=3"]) as guard:
        for step in guard.steps(0, 5):
            assert saver.poisoned == (1 if step >= 3 else 0)
    assert [(n, s) for n, s, _ in events] == [("fault", 3)]
    assert FaultPlan.from_args_and_env(["nan:step=3"], {}).due(3, 0, 0) == []  # not a process fault


def _nan_seen_by_rank_one_only(rank: int, world: int) -> str:
    guard = elastic.RunGuard(
        saver=_Saver([4]), watchdog_s=0, peer_timeout_s=0, attempt=0, rank=rank, env={}
    )
    try:
        with guard:
            for step in guard.steps(0, 6):
                guard.check(NAN if rank == 1 and step == 5 else 0.5)
    except Diverged as exc:
        return f"stopped at {exc.step}"
    return "finished"


def test_every_rank_stops_when_only_one_rank_sees_a_nan_loss():
    assert run_ok(_nan_seen_by_rank_one_only, 2, timeout_s=60) == ["stopped at 5"] * 2
