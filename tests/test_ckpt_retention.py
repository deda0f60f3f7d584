"""Retention: the keep/delete decision as a table, then applied to real directories."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import ckpt
from ckpt.root.retention import (
    DEFAULT_RETENTION,
    RetentionPolicy,
    apply_retention,
    describe,
    plan_retention,
)
from ckpt.storage import Storage

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("committed", "partial", "keep_last", "keep_every", "keep", "delete", "delete_partial"),
    [
        # nothing to do
        ([], [], 1, None, (), (), ()),
        # the newest is always kept
        ([5], [], 1, None, (5,), (), ()),
        ([1, 2, 3, 4], [], 1, None, (4,), (3, 2, 1), ()),
        ([1, 2, 3, 4], [], 2, None, (4, 3), (2, 1), ()),
        ([1, 2, 3], [], 10, None, (3, 2, 1), (), ()),
        # order of the input does not matter
        ([30, 10, 20], [], 2, None, (30, 20), (10,), ()),
        # keep_every keeps multiples forever, on top of the newest K
        ([100, 200, 300, 400, 500], [], 1, 200, (500, 400, 200), (300, 100), ()),
        ([1000, 1500, 2000, 2500], [], 2, 1000, (2500, 2000, 1000), (1500,), ()),
        # partial directories older than the newest committed are dead attempts
        ([10, 20], [15, 5], 5, None, (20, 10), (), (15, 5)),
        # a partial newer than every commit may be a save in flight: keep it
        ([10, 20], [30], 1, None, (20,), (10,), ()),
        # no commit at all: partials are never deleted (nothing proves they are dead)
        ([], [7, 8], 1, None, (), (), ()),
        # a step both committed and listed partial counts as committed
        ([10], [10], 1, None, (10,), (), ()),
    ],
)
def test_plan_retention_table(
    committed, partial, keep_last, keep_every, keep, delete, delete_partial
):
    plan = plan_retention(
        committed, partial, RetentionPolicy(keep_last=keep_last, keep_every=keep_every)
    )
    assert plan.keep == keep
    assert plan.delete == delete
    assert plan.delete_partial == delete_partial
    assert set(plan.keep).isdisjoint(plan.delete)
    if committed:
        assert max(committed) in plan.keep  # the newest is never deleted


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"keep_last": 0}, "keep_last"), ({"keep_last": -1}, "keep_last"),
     ({"keep_last": True}, "keep_last"), ({"keep_last": 1, "keep_every": 0}, "keep_every")],
)  # fmt: skip
def test_policy_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RetentionPolicy(**kwargs)


def _save(root: str, step: int) -> None:
    ckpt.save({"w": torch.full((4,), float(step)), "step": step}, root, step)


def test_apply_retention_deletes_old_and_dead_partial(memory_root):
    for step in (100, 200, 300, 400):
        _save(memory_root, step)
    _save(memory_root, 250)  # a dead attempt's partial directory, older than 400: it was
    Storage(memory_root).remove("checkpoint_0000250/COMPLETE")  # killed before COMPLETE
    dry = apply_retention(memory_root, RetentionPolicy(keep_last=2, keep_every=200), dry_run=True)
    assert [i.step for i in ckpt.list_checkpoints(memory_root)] == [400, 300, 250, 200, 100]
    plan = apply_retention(memory_root, RetentionPolicy(keep_last=2, keep_every=200))
    assert plan == dry
    assert plan.keep == (400, 300, 200) and plan.delete == (100,) and plan.delete_partial == (250,)
    remaining = ckpt.list_checkpoints(memory_root)
    assert [(i.step, i.committed) for i in remaining] == [(400, True), (300, True), (200, True)]
    state = {"w": torch.zeros(4), "step": -1}
    assert ckpt.load(state, memory_root).step == 400


def test_save_with_retention_runs_in_the_background_on_the_coordinator(tmp_root):
    import time

    for step in (1, 2, 3):
        ckpt.save({"w": torch.zeros(2), "step": step}, tmp_root, step,
                  retention=ckpt.RetentionPolicy(keep_last=2))  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(ckpt.list_checkpoints(tmp_root)) > 2:
        time.sleep(0.05)
    assert [i.step for i in ckpt.list_checkpoints(tmp_root)] == [3, 2]


@pytest.mark.parametrize(
    ("committed", "protect", "keep_last", "keep", "delete"),
    [
        # the checkpoint a run resumed from survives however old it gets
        ([10, 20, 30, 40], {10}, 1, (40, 10), (30, 20)),
        ([10, 20, 30, 40], {30}, 2, (40, 30), (20, 10)),  # already among the newest: no extra
        ([10, 20, 30], {99}, 1, (30,), (20, 10)),  # a protected step not on disk changes nothing
    ],
)
def test_plan_retention_never_deletes_a_protected_step(committed, protect, keep_last, keep, delete):
    policy = RetentionPolicy(keep_last=keep_last, protect=frozenset(protect))
    plan = plan_retention(committed, [], policy)
    assert plan.keep == keep and plan.delete == delete


@pytest.mark.parametrize(
    ("policy", "says"),
    [
        (None, "every committed checkpoint is kept"),
        (RetentionPolicy(keep_last=3), "keeps the newest 3 committed"),
        (RetentionPolicy(keep_last=2, keep_every=100), "every step that is a multiple of 100"),
    ],
)
def test_describe_says_the_policy_in_one_line(policy, says):
    text = describe(policy)
    assert says in text and "\n" not in text


def test_default_retention_keeps_the_newest_three():
    assert DEFAULT_RETENTION.keep_last == 3 and not DEFAULT_RETENTION.keep_every


def test_a_checkpoint_pruned_by_another_prune_meanwhile_is_not_an_error(tmp_root, monkeypatch):
    # the manager's background retention and a user's `ckpt gc` prune the same root: the
    # other one deletes the directory just as this one wrote its claim there
    from ckpt.storage.local import LocalBackend

    for step in (1, 2, 3):
        _save(tmp_root, step)
    real_check = LocalBackend.check_written
    raced: list[str] = []

    def other_prune_meanwhile(self, path, size, crc):
        if path.endswith("/ATTEMPT") and not raced:
            raced.append(os.path.relpath(path, tmp_root))
            shutil.rmtree(os.path.dirname(path))
        return real_check(self, path, size, crc)

    monkeypatch.setattr(LocalBackend, "check_written", other_prune_meanwhile)
    plan = apply_retention(tmp_root, RetentionPolicy(keep_last=1))
    assert raced == ["checkpoint_0000002/ATTEMPT"] and plan.delete == (2, 1)
    assert sorted(os.listdir(tmp_root)) == ["checkpoint_0000003"]
    assert ckpt.load({"w": torch.zeros(4), "step": -1}, tmp_root).step == 3
