"""Save-decision policies: by steps, by the clock, both, or a class of the user's.

A clock decision must be the same on every rank: each rank's clock and step times
differ, and a save is a collective, so a rank that decided alone would wait for the
others forever. The manager takes rank 0's answer to every rank.
"""

from __future__ import annotations

import pytest
import torch

import ckpt
from ckpt.saving.decisions import SaveDecisions
from ckpt.saving.policy import AnyOf, EveryNSteps, EverySeconds, SaveContext
from testing.spawn import run_ok

pytestmark = pytest.mark.timeout(120)


def ctx(now: float, last: float | None = None, *, in_flight: bool = False) -> SaveContext:
    return SaveContext(now=now, last_save_time=last, started=0.0, in_flight=in_flight)


@pytest.mark.parametrize(
    ("policy", "step", "final", "context", "due"),
    [
        (EverySeconds(10.0), 1, False, ctx(9.9), False),
        (EverySeconds(10.0), 1, False, ctx(10.0), True),  # from the manager's start
        (EverySeconds(10.0), 5, False, ctx(25.0, last=20.0), False),
        (EverySeconds(10.0), 5, False, ctx(31.0, last=20.0), True),
        (EverySeconds(10.0), 5, False, ctx(31.0, last=20.0, in_flight=True), False),
        (EverySeconds(10.0), 5, True, ctx(0.0), True),
        (EverySeconds(10.0, at_final=False), 5, True, ctx(99.0), False),
        (EverySeconds(10.0), 5, False, None, False),
        (AnyOf((EveryNSteps(4), EverySeconds(10.0))), 4, False, ctx(1.0), True),
        (AnyOf((EveryNSteps(4), EverySeconds(10.0))), 5, False, ctx(11.0), True),
        (AnyOf((EveryNSteps(4), EverySeconds(10.0))), 5, False, ctx(1.0), False),
    ],
)  # fmt: skip
def test_policy_table(policy, step, final, context, due):
    assert policy.should_save(step, final=final, context=context) is due


def test_options_build_the_durable_policy_and_check_their_fields():
    assert ckpt.CheckpointOptions(every=5).durable_policy() == EveryNSteps(5)
    both = ckpt.CheckpointOptions(every=5, every_s=60).durable_policy()
    assert both == AnyOf((EveryNSteps(5), EverySeconds(60.0))) and both.uses_clock
    mine = EveryNSteps(3)
    assert ckpt.CheckpointOptions(every=5, policy=mine).durable_policy() is mine
    with pytest.raises(ValueError, match="every_s="):
        ckpt.CheckpointOptions(every_s=float("inf"))
    with pytest.raises(ValueError, match="policy="):
        ckpt.CheckpointOptions(policy="hourly")


class OnLossPlateau:
    """A custom policy: save when asked to, and at the end (what the docs show)."""

    uses_clock = False

    def __init__(self) -> None:
        self.flagged: set[int] = set()

    def should_save(self, step, *, final, context=None):
        return final or step in self.flagged


def test_a_custom_policy_class_decides_the_durable_saves(tmp_path):
    policy = OnLossPlateau()
    policy.flagged = {2, 5}
    model = torch.nn.Linear(2, 2)
    with ckpt.CheckpointManager(str(tmp_path / "c"), {"m": model}, policy=policy) as manager:
        for step in range(1, 8):
            manager.maybe_save(step, final=step == 7)
    assert [i.step for i in ckpt.list_checkpoints(str(tmp_path / "c"))] == [7, 5, 2]


def _skewed_clocks(rank: int, world: int, root: str) -> list[int]:
    model = torch.nn.Linear(2, 2)
    with ckpt.CheckpointManager(root, {"m": model}, every=0, every_s=1.0, keep_last=0) as m:
        now = [0.0]
        speed = 1.0 if rank == 0 else 3.7  # rank 1's steps look 3.7x longer to its clock
        m._decisions = SaveDecisions(m._group, clock=lambda: now[0])
        for step in range(1, 13):
            now[0] += 0.3 * speed
            m.maybe_save(step, final=step == 12)
    return [i.step for i in ckpt.list_checkpoints(root)]


def test_a_clock_policy_saves_the_same_steps_on_every_rank_whatever_their_clocks(tmp_path):
    steps = run_ok(_skewed_clocks, 2, str(tmp_path / "c"))
    # rank 0's clock: 0.3 s a step, due once 1 s passed since the last save
    assert steps[0] == steps[1] == [12, 8, 4]
