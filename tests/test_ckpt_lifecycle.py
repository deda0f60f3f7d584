"""Fail-safe lifecycle of a run's checkpoints: a root that cannot hold them is refused
before training, failed saves stop the job instead of losing its work silently, and a
full disk says so and gets its space back.

Multi-rank cases run on real processes (gloo, ``testing.spawn``); unwritable and full
roots are real tmpfs mounts (``testing.mounts``), unmounted at the end of each test.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import time

import pytest
import torch

import ckpt
from ckpt.root.root_check import _parents
from ckpt.storage import Storage
from ckpt.storage.local import is_disk_full
from testing import mounts
from testing.spawn import run_ok

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def can_mount() -> None:
    problem = mounts.mount_problem()
    if problem is not None:
        pytest.skip(problem)


def _model(width: int = 8) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _manager(
    root: str, **kwargs
) -> tuple[ckpt.CheckpointManager, torch.nn.Module, torch.optim.Optimizer]:
    model, optim = _model()
    return ckpt.CheckpointManager(root, {"model": model, "optim": optim}, **kwargs), model, optim


def _train_step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.ones(2, model.in_features)).sum().backward()
    optim.step()
    optim.zero_grad()


def _tree_digest(root: str) -> dict[str, str]:
    """Every file and directory under ``root`` with a sha256 of its bytes."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), root) + "/"] = "dir"
        for name in filenames:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _error_of(fn, *args) -> tuple[str, str]:
    try:
        fn(*args)
    except ckpt.CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return "none", ""


# -- the root probe -------------------------------------------------------------------


def _resume_on(rank: int, world: int, root: str) -> tuple[str, str, float]:
    model, optim = _model()
    manager = ckpt.CheckpointManager(root, {"model": model, "optim": optim}, every=1)
    started = time.monotonic()
    kind, message = _error_of(manager.resume)
    manager.close()
    return kind, message, time.monotonic() - started


def test_an_existing_root_the_job_cannot_write_is_refused_on_every_rank(tmp_path, can_mount):
    mount = str(tmp_path / "ro")
    with mounts.tmpfs(mount, size="1m"):
        root = os.path.join(mount, "ckpt")
        os.makedirs(root)
        mounts.make_read_only(mount)
        results = run_ok(_resume_on, 2, root, timeout_s=120)
    for kind, message, seconds in results:
        assert kind == "CheckpointDirError", message
        assert root in message and "Read-only file system" in message, message
        assert seconds < 30
    assert results[0][1] == results[1][1]  # the same error, decided together


def _root_listings_in_resume(rank: int, world: int, root: str) -> tuple[int, int | None]:
    """Save steps 1-3, then resume with every listing of the root counted: (count, step)."""
    model, optim = _model()
    with ckpt.CheckpointManager(root, {"model": model, "optim": optim}, retention=None) as m:
        for step in (1, 2, 3):
            m.save(step)
    listings = []
    original = Storage.list_dir

    def counted(storage: Storage, key: str = "") -> list[tuple[str, bool]]:
        if storage.path(key).rstrip("/") == root.rstrip("/"):
            listings.append(key)
        return original(storage, key)

    Storage.list_dir = counted
    try:
        model, optim = _model()
        with ckpt.CheckpointManager(root, {"model": model, "optim": optim}) as m:
            step = m.resume()
    finally:
        Storage.list_dir = original
    return len(listings), step


def test_a_resume_lists_the_root_once_on_the_coordinator_and_never_elsewhere(tmp_path):
    # The root check and the discovery share one listing: on a root of a thousand
    # checkpoints every extra listing was as long as the rest of a resume.
    results = run_ok(_root_listings_in_resume, 2, str(tmp_path / "ckpt"), timeout_s=120)
    assert results == [(1, 3), (0, 3)]


def test_a_writable_root_passes_the_probe_and_leaves_no_probe_object(tmp_path):
    root = str(tmp_path / "ckpt")
    model, optim = _model()
    manager = ckpt.CheckpointManager(root, {"model": model, "optim": optim})
    assert manager.resume() is None
    manager.close()
    assert os.listdir(root) == []


# -- a root that is, or is inside, a checkpoint ----------------------------------------


def test_a_root_that_is_or_is_inside_a_checkpoint_is_refused_and_left_untouched(tmp_path):
    root = str(tmp_path / "ckpt")
    model, optim = _model()
    with ckpt.CheckpointManager(root, {"model": model, "optim": optim}) as manager:
        assert manager.save(2) is not None
    committed = os.path.join(root, "checkpoint_0000002")
    before = _tree_digest(root)
    for wrong in (
        committed,  # a pasted checkpoint URL
        committed + "/",
        os.path.join(committed, "nested"),  # inside one
        os.path.join(root, "checkpoint_0000009"),  # named like one, next to checkpoints
    ):
        model, optim = _model()
        manager = ckpt.CheckpointManager(wrong, {"model": model, "optim": optim}, every=1)
        with pytest.raises(ckpt.CheckpointDirError) as caught:
            manager.resume()
        manager.close()
        assert f"--ckpt-dir {root}" in str(caught.value), (wrong, caught.value)
    assert _tree_digest(root) == before


def test_a_root_named_like_a_checkpoint_but_among_no_checkpoints_is_accepted(tmp_path):
    root = str(tmp_path / "checkpoint_0000001")
    model, optim = _model()
    with ckpt.CheckpointManager(root, {"model": model, "optim": optim}) as manager:
        assert manager.resume() is None
        assert manager.save(1) is not None


def test_on_gcs_the_probe_leaves_nothing_and_a_checkpoint_url_is_refused(gcs_root):
    model, optim = _model()
    with ckpt.CheckpointManager(gcs_root, {"model": model, "optim": optim}) as manager:
        assert manager.resume() is None
        assert manager.save(2) is not None
    before = Storage(gcs_root).list_files()
    assert all(name.startswith("checkpoint_0000002/") for name in before), sorted(before)
    model, optim = _model()
    inside = ckpt.CheckpointManager(f"{gcs_root}/checkpoint_0000002", {"model": model})
    with pytest.raises(ckpt.CheckpointDirError, match=f"--ckpt-dir {gcs_root}"):
        inside.resume()
    inside.close()
    assert Storage(gcs_root).list_files().keys() == before.keys()


@pytest.mark.parametrize(
    ("url", "parents"),
    [
        ("gs://bucket/a/b", ["gs://bucket/a"]),
        ("gs://bucket/a", []),
        ("memory://run/x/y", ["memory://run/x", "memory://run"]),
        ("/r/a/b", ["/r/a", "/r", "/"]),
        ("file:///r/a", ["file:///r", "file:///"]),
    ],
)
def test_the_parents_checked_stop_at_the_bucket(url, parents):
    assert _parents(Storage(url)) == parents


# -- resume must -------------------------------------------------------------------------


def test_resume_must_fails_on_an_empty_root_and_a_plain_resume_says_it_starts_fresh(
    tmp_path, caplog
):
    root = str(tmp_path / "typo")
    model, optim = _model()
    with ckpt.CheckpointManager(root, {"model": model, "optim": optim}) as manager:
        with pytest.raises(ckpt.CheckpointNotFoundError, match=root):
            manager.resume(must=True)
        with caplog.at_level(logging.WARNING, logger="ckpt.manager"):
            assert manager.resume() is None
        said = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert any(
            f"no committed checkpoint under {root}: starting from step 0" in r.getMessage()
            for r in said
        ), [r.getMessage() for r in said]
        assert manager.save(3) is not None
        assert manager.resume(must=True) == 3


# -- failed saves ------------------------------------------------------------------------


def _save_until_stopped(
    rank: int, world: int, root: str, async_save: bool, fault_rank: int
) -> dict:
    model, optim = _model()
    manager = ckpt.CheckpointManager(
        root, {"model": model, "optim": optim}, every=1, async_save=async_save, max_failures=3
    )
    manager.resume()
    # Every shard write of one rank fails; saves are collective, so every rank's save fails.
    manager.inject_storage_fault(
        f"ckpt-storage:phase=shard:error=permanent:times=100:rank={fault_rank}"
    )
    stopped_at, message = None, ""
    for step in range(1, 9):
        _train_step(model, optim)
        try:
            manager.maybe_save(step)
        except ckpt.TooManySaveFailuresError as exc:
            stopped_at, message = step, str(exc)
            break
    manager.close()
    return {"stopped_at": stopped_at, "message": message, "failures": manager.consecutive_failures}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_max_failures_saves_in_a_row_stop_every_rank_at_the_same_step(tmp_path, async_save):
    root = str(tmp_path / "ckpt")
    results = run_ok(_save_until_stopped, 2, root, async_save, 1, timeout_s=150)
    # An async save's failure is known when the next save collects it: one step later.
    expected = 4 if async_save else 3
    assert [r["stopped_at"] for r in results] == [expected, expected], results
    assert [r["failures"] for r in results] == [3, 3]
    for r in results:
        assert "3 checkpoint saves in a row failed" in r["message"] and root in r["message"]
    assert [i for i in ckpt.list_checkpoints(root) if i.committed] == []


def test_a_commit_resets_the_count_of_failed_saves(tmp_path):
    root = str(tmp_path / "ckpt")
    manager, model, optim = _manager(root, every=1, max_failures=3)
    manager.inject_storage_fault("ckpt-storage:phase=shard:error=permanent:times=2")
    outcomes = []
    for step in range(1, 7):
        _train_step(model, optim)
        outcomes.append(manager.maybe_save(step) is not None)
        if step == 3:
            manager.inject_storage_fault("ckpt-storage:phase=shard:error=permanent:times=2")
    manager.close()
    assert outcomes == [False, False, True, False, False, True]
    assert manager.consecutive_failures == 0


def test_a_failed_final_save_raises_even_when_failures_never_stop_the_job(tmp_path):
    root = str(tmp_path / "ckpt")
    manager, model, optim = _manager(root, every=0, max_failures=0)
    manager.inject_storage_fault("ckpt-storage:phase=complete:error=permanent")
    _train_step(model, optim)
    with pytest.raises(ckpt.TooManySaveFailuresError, match="final checkpoint at step 1"):
        manager.maybe_save(1, final=True)
    manager.close()
    assert ckpt.find_latest_committed(root) is None
    assert os.listdir(root) == []  # the failed save's directory is gone


def test_max_failures_is_validated():
    model, _ = _model()
    with pytest.raises(ValueError, match="max_failures"):
        ckpt.CheckpointManager("memory://x/run", {"model": model}, max_failures=-1)


# -- a full disk ---------------------------------------------------------------------------


def test_a_full_disk_says_so_removes_the_partial_save_and_keeps_the_committed_one(
    tmp_path, can_mount
):
    mount = str(tmp_path / "small")
    with mounts.tmpfs(mount, size="6m"):
        root = os.path.join(mount, "ckpt")
        small, small_optim = _model(8)
        with ckpt.CheckpointManager(root, {"model": small, "optim": small_optim}) as first:
            assert first.save(1) is not None
        committed = _tree_digest(root)
        big, big_optim = _model(1536)  # 9 MB of weights: more than fits
        _train_step(big, big_optim)
        manager = ckpt.CheckpointManager(
            root, {"model": big, "optim": big_optim}, every=1, max_failures=1
        )
        with pytest.raises(ckpt.TooManySaveFailuresError) as caught:
            manager.maybe_save(2)
        manager.close()
        assert "no space left on device" in str(caught.value), caught.value
        assert sorted(os.listdir(root)) == ["checkpoint_0000001"]
        assert _tree_digest(root) == committed
        usage = shutil.disk_usage(mount)
        assert usage.used < 1 << 20  # the space of the failed save came back


@pytest.mark.parametrize(
    ("exc", "full"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
        (PermissionError(errno.EACCES, "Permission denied"), False),
        (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos"), False),
    ],
)
def test_disk_full_is_recognized_by_errno(exc, full):
    assert is_disk_full(exc) is full


def test_disk_full_is_recognized_behind_torchs_zip_writer_error():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError(  # noqa: B904 (implicit chaining, as torch's writer does)
                "[enforce fail at inline_container.cc:672] . unexpected pos 704"
            )
    except RuntimeError as exc:
        assert is_disk_full(exc)
