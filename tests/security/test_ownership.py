"""Nothing is deleted that is not provably ours: retention, gc and a save's clean-up.

Each case plants something a user (or another job) could leave under a root, then runs
automatic retention, ``python -m ckpt gc`` and a save, and checks every foreign byte is
still in place, and that what is ours is handled exactly as before.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import ckpt
from ckpt import cli
from ckpt.format.layout import ATTEMPT_NAME
from ckpt.root.retention import RetentionPolicy, apply_retention


def _save(root: str, step: int, **kw) -> None:
    ckpt.save({"w": torch.full((8,), float(step)), "step": step}, root, step, **kw)


def _names(root: str) -> list[str]:
    return sorted(os.listdir(root))


def _tree(path: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, files in os.walk(path):
        for name in files:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "root")


def test_retention_leaves_a_checkpoint_holding_a_users_file_and_says_why(root, caplog):
    for step in (1, 2, 3):
        _save(root, step)
    notes = os.path.join(root, "checkpoint_0000001", "notes.txt")
    with open(notes, "w") as f:
        f.write("my eval results")
    before = _tree(os.path.join(root, "checkpoint_0000001"))
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        plan = apply_retention(root, RetentionPolicy(keep_last=1), run_id="local")
    assert plan.delete == (2, 1) and set(plan.refused) == {1}
    assert "notes.txt" in plan.refused[1]
    assert _names(root) == ["checkpoint_0000001", "checkpoint_0000003"]
    assert _tree(os.path.join(root, "checkpoint_0000001")) == before  # COMPLETE included
    assert any("notes.txt" in r.getMessage() for r in caplog.records)
    # the gc command says so too, and the next save's automatic retention does the same
    assert cli.main(["gc", root, "--keep-last", "1"]) == 0
    _save(root, 4, retention=RetentionPolicy(keep_last=1))
    ckpt.close()
    assert _names(root) == ["checkpoint_0000001", "checkpoint_0000004"]
    assert _tree(os.path.join(root, "checkpoint_0000001")) == before


def test_gc_quarantined_deletes_only_directories_quarantine_set_aside(root, capsys):
    _save(root, 1)
    forged = os.path.join(root, "checkpoint_0000007.quarantined-20260101T000000000Z")
    os.makedirs(forged)
    with open(os.path.join(forged, "rank_00000.distcp"), "wb") as f:
        f.write(b"a user's file under a quarantine-like name")
    record_wrong_stamp = os.path.join(root, "checkpoint_0000008.quarantined-20260101T000000001Z")
    os.makedirs(record_wrong_stamp)
    with open(os.path.join(record_wrong_stamp, "QUARANTINED"), "w") as f:
        json.dump({"step": 8, "stamp": "20990101T000000000Z", "reason": "forged"}, f)
    assert cli.main(["gc", root, "--quarantined"]) == 0
    out = capsys.readouterr().out
    assert "0 quarantined deleted, 2 left alone" in out
    assert os.path.exists(os.path.join(forged, "rank_00000.distcp"))
    assert os.path.exists(os.path.join(record_wrong_stamp, "QUARANTINED"))


def test_a_symlinked_checkpoint_is_never_read_through_nor_deleted_through(tmp_path, root):
    other = str(tmp_path / "other")
    _save(other, 2)  # another root's only checkpoint
    for step in (3, 4, 5):
        _save(root, step)
    os.symlink(os.path.join(other, "checkpoint_0000002"), os.path.join(root, "checkpoint_0000002"))
    before = _tree(other)
    plan = apply_retention(root, RetentionPolicy(keep_last=1), run_id="local")
    assert plan.delete == (4, 3)  # the link is not one of this root's checkpoints
    assert cli.main(["gc", root, "--keep-last", "1", "--quarantined"]) == 0
    assert _tree(other) == before
    assert os.path.islink(os.path.join(root, "checkpoint_0000002"))
    state = {"w": torch.zeros(8), "step": -1}
    assert ckpt.load(state, root).step == 5
    # a save at the link's step refuses instead of writing into the other root
    with pytest.raises(ckpt.CheckpointDirError, match="symbolic link"):
        _save(root, 2)
    assert _tree(other) == before


def test_a_checkpoint_renamed_by_hand_is_quarantined_never_deleted(root, caplog):
    for step in (40, 44):
        _save(root, step)
    os.rename(os.path.join(root, "checkpoint_0000044"), os.path.join(root, "checkpoint_0000050"))
    moved = _tree(os.path.join(root, "checkpoint_0000050"))
    assert [(i.step, i.status) for i in ckpt.list_checkpoints(root)] == [
        (50, "renamed"),
        (40, "committed"),
    ]
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        _save(root, 50)  # the save that would have cleared it as "leftovers"
    aside = [n for n in _names(root) if n.startswith("checkpoint_0000050.quarantined-")]
    assert len(aside) == 1
    kept = _tree(os.path.join(root, aside[0]))
    assert {k: v for k, v in kept.items() if k != "QUARANTINED" and k != "COMPLETE"} == {
        k: v for k, v in moved.items() if k != "COMPLETE"
    }
    assert any("renamed" in r.getMessage() for r in caplog.records)
    assert ckpt.load({"w": torch.zeros(8), "step": -1}, root).step == 50
    # retention, meeting one, sets it aside too
    _save(root, 60)
    os.rename(os.path.join(root, "checkpoint_0000040"), os.path.join(root, "checkpoint_0000045"))
    plan = apply_retention(root, RetentionPolicy(keep_last=1), run_id="local")
    assert 45 in plan.set_aside and not os.path.exists(os.path.join(root, "checkpoint_0000045"))


def test_stray_entries_named_like_checkpoints_break_nothing(root):
    _save(root, 1)
    with open(os.path.join(root, "checkpoint_0000009"), "w") as f:
        f.write("a file, not a directory")
    infos = ckpt.list_checkpoints(root)
    assert [i.step for i in infos] == [1]
    assert ckpt.load({"w": torch.zeros(8), "step": -1}, root).step == 1
    apply_retention(root, RetentionPolicy(keep_last=1), run_id="local")
    assert os.path.isfile(os.path.join(root, "checkpoint_0000009"))
    with pytest.raises(ckpt.CheckpointDirError, match="not a directory"):
        _save(root, 9)


def test_partial_directories_are_cleared_only_for_the_run_their_records_name(root, caplog):
    for step in (1, 3):
        _save(root, step)
    other_run = os.path.join(root, "checkpoint_0000002")
    os.makedirs(other_run)
    with open(os.path.join(other_run, ATTEMPT_NAME), "w") as f:
        json.dump({"run_id": "job-b", "restart_count": 0, "save_id": "x", "host": "h"}, f)
    with open(os.path.join(other_run, "rank_00000.distcp"), "wb") as f:
        f.write(b"job b's save in flight")
    no_record = os.path.join(root, "checkpoint_0000000")
    os.makedirs(no_record)
    with open(os.path.join(no_record, "rank_00003.distcp"), "wb") as f:
        f.write(b"who wrote this?")
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        plan = apply_retention(root, RetentionPolicy(keep_last=5), run_id="local")
    assert set(plan.refused) == {0, 2}
    assert "job-b" in plan.refused[2] and "no record" in plan.refused[0]
    assert os.path.exists(other_run) and os.path.exists(no_record)
    # this run's own dead attempt (its ATTEMPT record names it) is cleared as before
    with open(os.path.join(other_run, ATTEMPT_NAME), "w") as f:
        json.dump({"run_id": "local", "restart_count": 0, "save_id": "y", "host": "h"}, f)
    plan = apply_retention(root, RetentionPolicy(keep_last=5), run_id="local")
    assert plan.delete_partial == (2, 0) and set(plan.refused) == {0}
    assert not os.path.exists(other_run)
    # the operator's gc may clear another run's recorded leftovers; never unrecorded ones
    assert cli.main(["gc", root, "--keep-last", "5"]) == 0
    assert os.path.exists(no_record)


def test_a_save_refuses_to_clear_a_directory_holding_foreign_files(root):
    _save(root, 1)
    leftover = os.path.join(root, "checkpoint_0000002")
    os.makedirs(leftover)
    with open(os.path.join(leftover, "README"), "w") as f:
        f.write("keep me")
    with pytest.raises(ckpt.CheckpointDirError, match="README"):
        _save(root, 2)
    assert _names(leftover) == ["README"]


def test_a_committed_checkpoint_loses_its_attempt_record_and_keeps_the_documented_files(root):
    _save(root, 1)
    assert _names(os.path.join(root, "checkpoint_0000001")) == sorted(
        [".metadata", "COMPLETE", "manifest.json", "rank_00000.distcp"]
    )
