"""Quarantine: a committed checkpoint that fails verification is set aside, never looped on.

Before, a damaged newest checkpoint made resume fall back, re-run the steps and then
fail every save of the same step (committed checkpoints are never overwritten): a
crash loop. These tests pin the protocol of ckpt/root/quarantine.py on local, memory://
and gs:// roots, its crash safety, and what ``python -m ckpt`` says about it.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys

import fsspec
import pytest
import torch
from test_ckpt_core import _corrupt_flip, blank_state, gcs_crc, make_state, read, write

import ckpt
from ckpt import cli
from ckpt.errors import (
    CheckpointUnreadableError,
    CorruptCheckpointError,
    NoLoadableCheckpointError,
    StorageError,
    UncommittedCheckpointError,
)
from ckpt.format.layout import COMPLETE_NAME, QUARANTINE_MARKER_NAME
from ckpt.loading.reader import ShardReader
from ckpt.root.catalog import QUARANTINED, list_checkpoints
from ckpt.root.quarantine import (
    list_quarantined,
    parse_quarantined_dirname,
    quarantine,
    should_quarantine,
)
from ckpt.root.retention import RetentionPolicy, apply_retention
from ckpt.storage import Storage

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["memory", "local", "gcs"])
def root(request, tmp_path) -> str:
    if request.param == "memory":
        return f"memory://quarantine-{os.urandom(6).hex()}/run"
    if request.param == "local":
        return str(tmp_path / "ckpts")
    return request.getfixturevalue("gcs_root")


def _names(root: str) -> list[str]:
    return sorted(name for name, _ in Storage(root).list_dir())


def _files(root: str, dirname: str) -> dict[str, bytes]:
    fs, path = fsspec.core.url_to_fs(root)
    base = f"{path}/{dirname}"
    return {name.removeprefix(base + "/"): fs.cat_file(name) for name in fs.find(base)}


def test_corrupt_newest_is_quarantined_and_its_step_saved_again(root):
    good = make_state(1)
    ckpt.save(good, root, 1)
    ckpt.save(make_state(2), root, 2)
    before = _files(root, "checkpoint_0000002")
    _corrupt_flip(root, "checkpoint_0000002/rank_00000.distcp")
    damaged = read(root, "checkpoint_0000002/rank_00000.distcp")

    events: list[dict] = []
    loaded = blank_state()
    result = ckpt.load(loaded, root, on_event=events.append)
    assert result.step == 1 and torch.equal(loaded["model"]["w"], good["model"]["w"])
    kinds = [e["event"] for e in events]
    assert kinds.index("ckpt_fallback") < kinds.index("ckpt_quarantined")
    event = next(e for e in events if e["event"] == "ckpt_quarantined")
    assert event["step"] == 2 and event["path"] == "rank_00000.distcp"

    names = _names(root)
    assert "checkpoint_0000002" not in names
    [aside] = [n for n in names if parse_quarantined_dirname(n) == 2]
    assert event["kept_at"].endswith(aside)
    kept = _files(root, aside)
    # Every file is kept for forensics (the damaged shard as it was), plus the record.
    assert kept["rank_00000.distcp"] == damaged
    for name in set(before) - {COMPLETE_NAME, "rank_00000.distcp"}:
        assert kept[name] == before[name], name
    record = json.loads(kept[QUARANTINE_MARKER_NAME])
    assert record["step"] == 2 and "rank_00000.distcp" in record["reason"]
    assert json.loads(record["complete_marker"])["step"] == 2
    assert COMPLETE_NAME not in kept  # never committed again under any name

    [q] = list_quarantined(Storage(root))
    assert q.step == 2 and q.path == "rank_00000.distcp"

    # The step can be committed again: no CheckpointExistsError, no crash loop.
    _assert_saved_again(root, 2, aside)


def _assert_saved_again(root: str, step: int, aside: str) -> None:
    """Save ``step`` anew after its quarantine; it loads, and the quarantined copy stays."""
    again = make_state(22)
    ckpt.save(again, root, step)
    loaded = blank_state()
    assert ckpt.load(loaded, root).step == step
    assert torch.equal(loaded["model"]["w"], again["model"]["w"])
    assert aside in _names(root)


def test_quarantine_can_be_turned_off(tmp_root):
    ckpt.save(make_state(1), tmp_root, 1)
    ckpt.save(make_state(2), tmp_root, 2)
    _corrupt_flip(tmp_root, "checkpoint_0000002/rank_00000.distcp")
    assert ckpt.load(blank_state(), tmp_root, quarantine=False).step == 1
    assert ckpt.find_latest_committed(tmp_root).step == 2


def test_interrupted_quarantine_is_never_resumed_nor_deleted(any_root):
    """Killed after COMPLETE went but before the move: quarantined in place, kept, finished later."""
    ckpt.save(make_state(1), any_root, 1)
    ckpt.save(make_state(2), any_root, 2)
    ckpt.save(make_state(3), any_root, 3)
    write(
        any_root, f"checkpoint_0000002/{QUARANTINE_MARKER_NAME}", b'{"reason": "r", "stamp": "1Z"}'
    )
    Storage(any_root).remove(f"checkpoint_0000002/{COMPLETE_NAME}")
    shard = read(any_root, "checkpoint_0000002/rank_00000.distcp")

    statuses = {i.step: i.status for i in list_checkpoints(any_root)}
    assert statuses == {3: "committed", 2: QUARANTINED, 1: "committed"}
    # Retention deletes old committed and dead partial checkpoints, not this one.
    plan = apply_retention(any_root, RetentionPolicy(keep_last=1))
    assert plan.delete == (1,) and plan.delete_partial == ()
    assert read(any_root, "checkpoint_0000002/rank_00000.distcp") == shard

    # A save of the same step finishes the move instead of deleting "leftovers".
    ckpt.save(make_state(5), any_root, 2)
    assert ckpt.find_latest_committed(any_root).step == 3
    [aside] = [n for n in _names(any_root) if parse_quarantined_dirname(n) == 2]
    assert aside.endswith(".quarantined-1Z")
    assert read(any_root, f"{aside}/rank_00000.distcp") == shard
    loaded = blank_state()
    assert ckpt.load(loaded, any_root, step=2).step == 2
    assert torch.equal(loaded["model"]["w"], make_state(5)["model"]["w"])


class _Killed(BaseException):
    """Stands for the process dying at this point: nothing after it runs, no clean-up."""


@pytest.fixture(params=["memory", "gcs"])
def object_store_root(request) -> str:
    if request.param == "memory":
        return f"memory://quarantine-{os.urandom(6).hex()}/run"
    return request.getfixturevalue("gcs_root")


def test_a_move_killed_half_way_on_an_object_store_is_never_resumed_and_is_finished_later(
    object_store_root, monkeypatch
):
    """On object stores the move is copy-then-delete; a kill between copies tears nothing."""
    root = object_store_root
    ckpt.save(make_state(1), root, 1)
    ckpt.save(make_state(2), root, 2)
    _corrupt_flip(root, "checkpoint_0000002/rank_00000.distcp")
    before = _files(root, "checkpoint_0000002")

    storage = Storage(root)
    real_copy = storage.backend.fs.copy
    copied: list[str] = []

    def copy_then_die(src, dst, *args, **kwargs):
        if len(copied) == 2:
            raise _Killed
        copied.append(dst)
        return real_copy(src, dst, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(storage.backend.fs, "copy", copy_then_die)
        with pytest.raises(_Killed):
            quarantine(storage, 2, "rank_00000.distcp: bad crc32c", "rank_00000.distcp")
    assert len(copied) == 2

    # The source is whole but no longer committed; resume passes over it (no fallback,
    # nothing to quarantine again) and neither a second copy nor the source is deleted.
    assert {i.step: i.status for i in list_checkpoints(root)} == {2: QUARANTINED, 1: "committed"}
    events: list[dict] = []
    assert ckpt.load(blank_state(), root, on_event=events.append).step == 1
    assert [e["event"] for e in events] == ["ckpt_loaded"]
    in_place = _files(root, "checkpoint_0000002")
    assert set(in_place) == set(before) - {COMPLETE_NAME} | {QUARANTINE_MARKER_NAME}
    assert all(in_place[k] == before[k] for k in set(before) - {COMPLETE_NAME})

    # The next save of step 2 finishes the move onto the same name, then commits.
    again = make_state(22)
    ckpt.save(again, root, 2)
    [aside] = [n for n in _names(root) if parse_quarantined_dirname(n) == 2]
    kept = _files(root, aside)
    assert {k: v for k, v in kept.items() if k != QUARANTINE_MARKER_NAME} == {
        k: v for k, v in before.items() if k != COMPLETE_NAME
    }
    assert json.loads(kept[QUARANTINE_MARKER_NAME])["path"] == "rank_00000.distcp"
    loaded = blank_state()
    assert ckpt.load(loaded, root).step == 2
    assert torch.equal(loaded["model"]["w"], again["model"]["w"])


@pytest.mark.parametrize("moved", [True, False], ids=["moved", "in-place"])
def test_a_root_with_only_quarantined_checkpoints_never_starts_from_scratch(any_root, moved):
    """The run's only checkpoint was set aside: the next resume stops, it does not start at 0."""
    ckpt.save(make_state(1), any_root, 1)
    _corrupt_flip(any_root, "checkpoint_0000001/rank_00000.distcp")
    if moved:
        with pytest.raises(ckpt.NoLoadableCheckpointError):
            ckpt.load(blank_state(), any_root, missing_ok=True)  # quarantines it
        assert "checkpoint_0000001" not in _names(any_root)
    else:  # a quarantine killed before its move
        write(any_root, f"checkpoint_0000001/{QUARANTINE_MARKER_NAME}", b'{"reason": "r"}')
        Storage(any_root).remove(f"checkpoint_0000001/{COMPLETE_NAME}")

    # The relaunch (a restart, or the user running the job again) sees no committed one.
    with pytest.raises(ckpt.NoLoadableCheckpointError) as refused:
        ckpt.load(blank_state(), any_root, missing_ok=True)
    message = str(refused.value)
    assert "only quarantined ones (steps [1])" in message
    assert f"python -m ckpt gc --quarantined {any_root}" in message
    assert refused.value.reasons == [(1, "quarantined")]

    # Deleting them is the decision to start from step 0.
    assert cli.main(["gc", any_root, "--quarantined"]) == 0
    assert ckpt.load(blank_state(), any_root, missing_ok=True) is None


def test_the_manager_refuses_a_fresh_start_over_quarantined_work(tmp_root):
    """CheckpointManager.resume (the trainer's path) applies the same rule as ckpt.load."""
    model = torch.nn.Linear(4, 4)
    manager = ckpt.CheckpointManager(tmp_root, {"model": model})
    manager.save(3)
    manager.close()
    _corrupt_flip(tmp_root, "checkpoint_0000003/rank_00000.distcp")

    for attempt in range(2):  # the resume that quarantines it, then the next one
        manager = ckpt.CheckpointManager(tmp_root, {"model": torch.nn.Linear(4, 4)})
        try:
            with pytest.raises(ckpt.NoLoadableCheckpointError) as refused:
                manager.resume()
        finally:
            manager.close()
        assert ("only quarantined ones" in str(refused.value)) == (attempt == 1)
    assert ckpt.find_latest_committed(tmp_root) is None
    assert [q.step for q in list_quarantined(Storage(tmp_root))] == [3]


def test_only_damage_quarantines_not_storage_trouble():
    assert should_quarantine(CorruptCheckpointError("bad crc32c"))
    assert not should_quarantine(UncommittedCheckpointError("pruned while listing"))
    assert not should_quarantine(StorageError("503 after retries"))
    assert not should_quarantine(CheckpointUnreadableError("out of memory while loading"))


def _fail_for_step_2(real, exc: Exception):
    """Wrap a Storage/ShardReader method: raise ``exc`` for checkpoint 2, else call through."""

    def wrapper(self, *args, **kwargs):
        storage = getattr(self, "ckpt_dir", self)
        if storage.root_url.endswith("checkpoint_0000002"):
            raise exc
        return real(self, *args, **kwargs)

    return wrapper


@pytest.mark.parametrize(
    ("target", "attr", "exc"),
    [
        # verification cannot list the newest checkpoint's files (a storage outage)
        (Storage, "list_files", StorageError("503 Service Unavailable (after retries)")),
        # reading its shards fails outside the checkpoint (a storage outage, out of memory)
        (ShardReader, "_read_span", StorageError("connection reset (after retries)")),
        (ShardReader, "_use_span", RuntimeError("CUDA out of memory")),
    ],
    ids=["verify-listing-outage", "shard-read-outage", "out-of-memory"],
)
def test_trouble_outside_the_files_falls_back_but_never_quarantines(
    any_root, monkeypatch, target, attr, exc
):
    """A good checkpoint that could not be read this time stays committed, files untouched."""
    ckpt.save(make_state(1), any_root, 1)
    newest = make_state(2)
    ckpt.save(newest, any_root, 2)
    before = _files(any_root, "checkpoint_0000002")

    with monkeypatch.context() as patch:
        patch.setattr(target, attr, _fail_for_step_2(getattr(target, attr), exc))
        events: list[dict] = []
        result = ckpt.load(blank_state(), any_root, on_event=events.append)
    assert result.step == 1
    assert [e["event"] for e in events] == ["ckpt_fallback", "ckpt_loaded"]
    assert str(exc) in events[0]["reason"]

    assert _names(any_root) == ["checkpoint_0000001", "checkpoint_0000002"]
    assert _files(any_root, "checkpoint_0000002") == before
    loaded = blank_state()
    assert ckpt.load(loaded, any_root).step == 2  # the trouble passed: the newest loads again
    assert torch.equal(loaded["model"]["w"], newest["model"]["w"])


def test_ls_shows_quarantined_and_gc_removes_them_only_when_asked(tmp_root, capsys):
    for step in (1, 2, 3):
        ckpt.save(make_state(step), tmp_root, step)
    _corrupt_flip(tmp_root, "checkpoint_0000003/rank_00000.distcp")
    assert ckpt.load(blank_state(), tmp_root).step == 2
    capsys.readouterr()

    assert cli.main(["ls", tmp_root]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.split()[:2] == ["3", QUARANTINED])
    assert "rank_00000.distcp" in row
    assert "2 committed, 0 partial, 1 quarantined" in out
    assert cli.main(["ls", "--json", tmp_root]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"]) for r in rows] == [
        (2, "committed"),
        (1, "committed"),
        (3, QUARANTINED),
    ]

    assert cli.main(["gc", tmp_root, "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "kept          1 quarantined" in out
    assert any(parse_quarantined_dirname(n) == 3 for n in _names(tmp_root))
    assert cli.main(["gc", tmp_root, "--quarantined"]) == 0
    assert "1 quarantined deleted" in capsys.readouterr().out
    assert _names(tmp_root) == ["checkpoint_0000002"]


def test_verify_of_a_quarantined_directory_names_the_damage(any_root, capsys):
    """Forensics: a quarantined directory is checked against its own manifest.json."""
    ckpt.save(make_state(1), any_root, 1)
    ckpt.save(make_state(2), any_root, 2)
    _corrupt_flip(any_root, "checkpoint_0000002/rank_00000.distcp")
    assert ckpt.load(blank_state(), any_root).step == 1
    [aside] = [n for n in _names(any_root) if parse_quarantined_dirname(n) == 2]
    url = f"{any_root}/{aside}"
    capsys.readouterr()

    assert cli.main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL  {url} (step 2, checksum; quarantined: ")
    assert "\n      rank_00000.distcp: crc32c of the bytes is" in out

    # Repaired by hand (the flipped byte flipped back): it verifies; the reason is still said.
    _corrupt_flip(any_root, f"{aside}/rank_00000.distcp")
    assert cli.main(["verify", url]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK    {url} (step 2, checksum: ") and "quarantined for:" in out


def test_gc_needs_a_policy_or_quarantined(tmp_root):
    with pytest.raises(SystemExit) as exc:
        cli.main(["gc", tmp_root])
    assert exc.value.code == 2


def test_verify_refuses_metadata_resume_would_refuse(tmp_root, capsys):
    """A forged .metadata with matching crc32c passes size/crc checks; OK must mean loadable."""
    ckpt.save(make_state(1), tmp_root, 1)

    class Forged:
        def __reduce__(self):
            return (os.getpid, ())  # harmless, but code all the same: the safe loader refuses

    payload = pickle.dumps(Forged())
    manifest = json.loads(read(tmp_root, "checkpoint_0000001/manifest.json"))
    for entry in manifest["files"]:
        if entry["path"] == ".metadata":
            entry["size"], entry["crc32c"] = len(payload), gcs_crc(payload)
    new_manifest = json.dumps(manifest).encode()
    write(tmp_root, "checkpoint_0000001/.metadata", payload)
    write(tmp_root, "checkpoint_0000001/manifest.json", new_manifest)
    complete = json.loads(read(tmp_root, "checkpoint_0000001/COMPLETE"))
    complete["manifest_crc32c"] = gcs_crc(new_manifest)
    write(tmp_root, "checkpoint_0000001/COMPLETE", json.dumps(complete).encode())

    for mode in ([], ["--fast"], ["--deep"]):
        assert cli.main(["verify", tmp_root, *mode]) == 1
        out = capsys.readouterr().out
        assert out.startswith("FAIL") and ".metadata: not loadable" in out
    with pytest.raises(ckpt.NoLoadableCheckpointError):
        ckpt.load(blank_state(), tmp_root, quarantine=False)


def test_ls_into_a_closed_pipe_prints_no_traceback(tmp_path):
    root = tmp_path / "ckpts"
    for step in range(1500):  # ~150 KB of rows: more than a pipe holds
        (root / f"checkpoint_{step:07d}").mkdir(parents=True)
    proc = subprocess.run(
        f"{sys.executable} -m ckpt ls {root} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.stdout.startswith("      STEP")
    assert proc.stderr == "", proc.stderr


# -- a committed checkpoint whose manifest.json was damaged after its commit -----------------


def _damage_manifest(root: str, step: int, how: str) -> None:
    """Damage manifest.json of ``step`` after its commit; COMPLETE stays as it was."""
    rel = f"checkpoint_{step:07d}/manifest.json"
    data = read(root, rel)
    if how == "truncated":
        write(root, rel, data[: len(data) // 2])
    elif how == "byte changed":  # still valid JSON, no longer the bytes COMPLETE vouches for
        at = data.index(b'"created_at"') + len(b'"created_at": "')
        digit = data[at : at + 1]
        write(root, rel, data[:at] + (b"1" if digit != b"1" else b"2") + data[at + 1 :])
        assert json.loads(read(root, rel))  # parses: only the crc32c tells
    else:
        Storage(root).remove(rel)


DAMAGES = ["truncated", "byte changed", "deleted"]


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_manifest_under_a_valid_complete_is_a_damaged_commit_not_a_partial_save(
    any_root, how, capsys
):
    ckpt.save(make_state(1), any_root, 1)
    ckpt.save(make_state(2), any_root, 2)
    _damage_manifest(any_root, 2, how)
    [newest, older] = list_checkpoints(any_root)
    assert (newest.step, newest.status, older.status) == (2, "damaged", "committed")
    assert "manifest.json" in newest.reason and "COMPLETE is present" in newest.reason
    assert not newest.committed and newest.marker is not None and newest.marker.step == 2

    # `verify ROOT` fails on it instead of saying OK for step 1 alone.
    assert cli.main(["verify", any_root]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL") and "checkpoint_0000002" in out and "manifest.json" in out
    assert cli.main(["verify", any_root, "--step", "2"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert cli.main(["verify", any_root, "--step", "1"]) == 0
    capsys.readouterr()
    assert cli.main(["ls", any_root]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:2] == ["2", "damaged"] for line in out.splitlines())
    assert "1 committed, 0 partial, 0 quarantined, 1 damaged" in out
    assert cli.main(["ls", any_root, "--json"]) == 0
    rows = {r["step"]: r["status"] for r in json.loads(capsys.readouterr().out)}
    assert rows == {2: "damaged", 1: "committed"}


@pytest.mark.parametrize("how", DAMAGES)
def test_resume_falls_back_loudly_from_a_damaged_manifest_and_quarantines_it(any_root, how, caplog):
    good = make_state(1)
    ckpt.save(good, any_root, 1)
    ckpt.save(make_state(2), any_root, 2)
    before = _files(any_root, "checkpoint_0000002")
    _damage_manifest(any_root, 2, how)

    events: list[dict] = []
    loaded = blank_state()
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        result = ckpt.load(loaded, any_root, on_event=events.append)
    assert result.step == 1 and torch.equal(loaded["model"]["w"], good["model"]["w"])
    assert [s.step for s in result.skipped] == [2]
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(
        "checkpoint_0000002" in r.getMessage() and "falling back" in r.getMessage() for r in said
    )
    assert any("quarantined" in r.getMessage() and "manifest.json" in r.getMessage() for r in said)
    kinds = [e["event"] for e in events]
    assert kinds.index("ckpt_fallback") < kinds.index("ckpt_quarantined")

    # Set aside with every file it had (COMPLETE turned into the record), nothing deleted.
    names = _names(any_root)
    assert "checkpoint_0000002" not in names
    [aside] = [n for n in names if parse_quarantined_dirname(n) == 2]
    kept = _files(any_root, aside)
    for name in set(before) - {COMPLETE_NAME, "manifest.json"}:
        assert kept[name] == before[name], name
    assert ("manifest.json" in kept) == (how != "deleted")
    record = json.loads(kept[QUARANTINE_MARKER_NAME])
    assert record["path"] == "manifest.json" and json.loads(record["complete_marker"])["step"] == 2

    # The step is saved again, as after any quarantine.
    _assert_saved_again(any_root, 2, aside)


@pytest.mark.parametrize("how", DAMAGES)
def test_retention_and_a_save_of_its_step_set_a_damaged_commit_aside_never_delete_it(
    any_root, how, caplog
):
    for step in (1, 2, 3):
        ckpt.save(make_state(step), any_root, step)
    _damage_manifest(any_root, 2, how)
    before = _files(any_root, "checkpoint_0000002")
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        plan = apply_retention(any_root, RetentionPolicy(keep_last=1), run_id="local")
    assert plan.delete == (1,) and plan.delete_partial == () and not plan.refused
    assert set(plan.set_aside) == {2}
    [aside] = [n for n in _names(any_root) if parse_quarantined_dirname(n) == 2]
    kept = _files(any_root, aside)
    assert {k: v for k, v in kept.items() if k != QUARANTINE_MARKER_NAME} == {
        k: v for k, v in before.items() if k != COMPLETE_NAME
    }
    assert any("not deleted" in r.getMessage() for r in caplog.records)

    # A save of the step of a damaged commit (no resume set it aside first) moves it aside
    # too, instead of removing its files as "a dead attempt's leftovers".
    ckpt.save(make_state(5), any_root, 5)
    _damage_manifest(any_root, 5, how)
    before = _files(any_root, "checkpoint_0000005")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        ckpt.save(make_state(55), any_root, 5)
    assert not any("uncommitted save" in r.getMessage() for r in caplog.records)
    [aside] = [n for n in _names(any_root) if parse_quarantined_dirname(n) == 5]
    kept = _files(any_root, aside)
    for name in set(before) - {COMPLETE_NAME}:
        assert kept[name] == before[name], name
    loaded = blank_state()
    assert ckpt.load(loaded, any_root).step == 5
    assert torch.equal(loaded["model"]["w"], make_state(55)["model"]["w"])


def test_a_failed_save_never_removes_a_damaged_commit(tmp_root):
    from ckpt.saving.commit import _remove_failed_save

    ckpt.save(make_state(1), tmp_root, 1)
    _damage_manifest(tmp_root, 1, "truncated")
    before = _files(tmp_root, "checkpoint_0000001")
    _remove_failed_save(Storage(tmp_root), "checkpoint_0000001")
    assert _files(tmp_root, "checkpoint_0000001") == before


@pytest.mark.parametrize("how", DAMAGES)
def test_a_root_whose_only_commit_is_damaged_is_never_a_fresh_start(tmp_root, how):
    ckpt.save(make_state(1), tmp_root, 1)
    _damage_manifest(tmp_root, 1, how)
    with pytest.raises(NoLoadableCheckpointError, match="checkpoint_0000001"):
        ckpt.load(blank_state(), tmp_root, missing_ok=True)
    assert [parse_quarantined_dirname(n) for n in _names(tmp_root)] == [1]
    # the resume walk (no committed head to try) refuses too, and sets a damaged one aside
    ckpt.save(make_state(2), tmp_root, 2)
    _damage_manifest(tmp_root, 2, how)
    model = torch.nn.Linear(2, 2)
    manager = ckpt.CheckpointManager(tmp_root, {"model": model}, retention=None)
    with pytest.raises(NoLoadableCheckpointError):
        manager.resume()
    aside = [parse_quarantined_dirname(n) for n in _names(tmp_root)]
    assert sorted(s for s in aside if s is not None) == [1, 2]
    assert "checkpoint_0000002" not in _names(tmp_root)


def test_a_garbage_complete_stays_partial_and_a_vouched_hostile_manifest_is_damaged(tmp_root):
    from ckpt.format.checksum import crc32c_of

    ckpt.save(make_state(1), tmp_root, 1)
    ckpt.save(make_state(2), tmp_root, 2)
    # COMPLETE itself garbage (deep JSON): no commit to speak of, still partial
    write(tmp_root, "checkpoint_0000001/COMPLETE", b"[" * 30_000 + b"]" * 30_000)
    # a COMPLETE recomputed for a manifest nested 100k deep: read bounded, never loaded
    hostile = b"[" * 100_000 + b"]" * 100_000
    marker = json.loads(read(tmp_root, "checkpoint_0000002/COMPLETE"))
    marker["manifest_crc32c"] = crc32c_of(hostile)
    write(tmp_root, "checkpoint_0000002/manifest.json", hostile)
    write(tmp_root, "checkpoint_0000002/COMPLETE", json.dumps(marker).encode())
    statuses = {i.step: (i.status, i.reason) for i in list_checkpoints(tmp_root)}
    assert statuses[1][0] == "partial" and "COMPLETE is not a valid marker" in statuses[1][1]
    assert statuses[2][0] == "damaged" and "does not parse" in statuses[2][1]
    assert cli.main(["verify", tmp_root]) == 1
