"""One catalog per operation: a resume or a save lists the root once and reads only what it uses.

Before, a resume listed the root 3 times and read N+2 manifests (the manager found the
newest, restore.load inspected every directory, then inspected the candidate again), and
a save listed the root for its preparation and again for its fence check. These tests
count the storage calls, so a change that re-lists or re-reads fails here.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from test_ckpt_core import _corrupt_flip, blank_state, make_state, write

import ckpt
from ckpt.format.layout import COMPLETE_NAME, MANIFEST_NAME, QUARANTINE_MARKER_NAME
from ckpt.format.manifest import Attempt
from ckpt.root.catalog import COMMITTED, CORRUPT, PARTIAL, QUARANTINED, Catalog
from ckpt.saving import commit
from ckpt.storage import Storage

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Counts ``list_dir`` / ``list_files`` / ``read_bytes`` calls by (kind, URL)."""
    counter: Counter = Counter()
    for kind in ("list_dir", "list_files", "read_bytes"):
        original = getattr(Storage, kind)

        def counted(self, key: str = "", *args, _kind=kind, _original=original, **kwargs):
            counter[(_kind, self.url(key).rstrip("/"))] += 1
            return _original(self, key, *args, **kwargs)

        monkeypatch.setattr(Storage, kind, counted)
    return counter


def _manifest_reads(calls: Counter) -> dict[str, int]:
    return {
        url.rsplit("/", 2)[-2]: n
        for (kind, url), n in calls.items()
        if kind == "read_bytes" and url.endswith("/" + MANIFEST_NAME)
    }


def _root_listings(calls: Counter, root: str) -> int:
    return calls[("list_dir", Storage(root).url().rstrip("/"))]


def _mem_root() -> str:
    return f"memory://catalog-{os.urandom(6).hex()}/run"


def test_catalog_classifies_every_state_and_reads_only_down_to_the_newest_commit(calls):
    root = _mem_root()
    for step in (1, 2, 3):
        ckpt.save(make_state(step), root, step)
    write(root, "checkpoint_0000005/rank_00000.distcp", b"half a save")
    ckpt.save(make_state(4), root, 4)
    storage = Storage(root)
    write(root, f"checkpoint_0000004/{QUARANTINE_MARKER_NAME}", b'{"reason": "test"}')
    storage.remove(f"checkpoint_0000004/{COMPLETE_NAME}")
    calls.clear()

    catalog = Catalog(storage)
    latest = catalog.latest_committed()
    assert latest is not None and latest.step == 3 and latest.status == COMMITTED
    # Steps 5 (partial), 4 (quarantined in place) and 3 were inspected; 2 and 1 were not.
    assert _manifest_reads(calls) == {"checkpoint_0000003": 1}
    assert _root_listings(calls, root) == 1

    assert [(i.step, i.status) for i in catalog] == [
        (5, PARTIAL),
        (4, QUARANTINED),
        (3, COMMITTED),
        (2, COMMITTED),
        (1, COMMITTED),
    ]
    assert "test" in catalog.info(4).reason
    catalog.mark(3, CORRUPT, "flipped byte in rank_00000.distcp")
    assert catalog.latest_committed().step == 2
    assert catalog.info(3).reason == "flipped byte in rank_00000.distcp"
    # Each directory was read once, however often the catalog was asked.
    assert _root_listings(calls, root) == 1
    assert set(_manifest_reads(calls).values()) == {1}


def test_load_lists_the_root_once_and_reads_only_the_manifest_it_loads(calls):
    root = _mem_root()
    for step in range(1, 6):
        ckpt.save(make_state(step), root, step)
    calls.clear()

    loaded = blank_state()
    assert ckpt.load(loaded, root).step == 5
    assert torch.equal(loaded["model"]["w"], make_state(5)["model"]["w"])
    assert _root_listings(calls, root) == 1
    assert _manifest_reads(calls) == {"checkpoint_0000005": 1}


def test_a_fallback_reads_one_more_manifest_and_marks_the_catalog(calls):
    root = _mem_root()
    for step in range(1, 5):
        ckpt.save(make_state(step), root, step)
    _corrupt_flip(root, "checkpoint_0000004/rank_00000.distcp")
    calls.clear()

    catalog = Catalog(root)
    loaded = blank_state()
    result = ckpt.load(loaded, root, catalog=catalog, quarantine=False)
    assert result.step == 3 and [s.step for s in result.skipped] == [4]
    assert _root_listings(calls, root) == 1
    assert _manifest_reads(calls) == {"checkpoint_0000004": 1, "checkpoint_0000003": 1}
    # Not quarantined (turned off): still there, but this operation knows it is corrupt.
    assert catalog.info(4).status == CORRUPT and "rank_00000.distcp" in catalog.info(4).reason
    assert catalog.latest_committed().step == 3


def test_a_quarantine_is_recorded_in_the_catalog_it_used():
    root = _mem_root()
    for step in (1, 2):
        ckpt.save(make_state(step), root, step)
    _corrupt_flip(root, "checkpoint_0000002/rank_00000.distcp")
    catalog = Catalog(root)
    assert ckpt.load(blank_state(), root, catalog=catalog).step == 1
    assert catalog.info(2).status == QUARANTINED
    # A fresh catalog sees it moved away (not under its checkpoint name any more).
    fresh = Catalog(root)
    assert fresh.steps() == [1] and [q.step for q in fresh.quarantined()] == [2]


def test_manager_resume_reads_the_newest_manifest_once(calls, tmp_path):
    root = str(tmp_path / "ckpts")
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ckpt.CheckpointManager(root, {"model": model, "optim": optim}, retention=None)
    for step in (2, 4, 6, 8):
        manager.save(step)
    manager.close()
    calls.clear()

    again = ckpt.CheckpointManager(root, {"model": model, "optim": optim}, retention=None)
    assert again.resume() == 8
    again.close()
    # Was 3 reads of step 8's manifest and one of every older one.
    assert _manifest_reads(calls) == {"checkpoint_0000008": 1}


def test_save_preparation_lists_the_root_once_and_skips_a_missing_step_dir(calls):
    root = _mem_root()
    ckpt.save(make_state(1), root, 1)
    storage = Storage(root)
    attempt = Attempt(run_id="r", restart_count=0, save_id="s")
    calls.clear()

    commit._prepare(storage, "checkpoint_0000002", attempt, started_at=0.0)
    assert _root_listings(calls, root) == 1  # preparation and fence check share it
    assert not [url for kind, url in calls if kind == "list_files"]

    # Leftovers of a dead attempt at the step are still found and removed.
    write(root, "checkpoint_0000002/rank_00000.distcp", b"leftover")
    calls.clear()
    commit._prepare(storage, "checkpoint_0000002", attempt, started_at=0.0)
    assert _root_listings(calls, root) == 1
    assert not storage.exists("checkpoint_0000002/rank_00000.distcp")


def test_a_local_listing_reads_each_entry_s_kind_from_the_directory_without_a_stat(
    tmp_path, monkeypatch
):
    # fsspec's ls(detail=True) stats every entry: on a root of 1,000 checkpoints that was
    # the whole of a discovery's growth from 10 checkpoints (bench curves, BENCHMARKS.md).
    root = tmp_path / "root"
    for name in ("checkpoint_0000001", "checkpoint_0000002", ".quarantined-x"):
        (root / name).mkdir(parents=True)
    (root / ".probe-a").write_text("x")
    (root / "checkpoint_0000003").symlink_to(root / "checkpoint_0000002")
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda *a, **k: stats.append(a) or real_stat(*a, **k))
    storage = Storage(str(root))
    assert sorted(storage.list_dir()) == [
        (".probe-a", "file"),
        (".quarantined-x", "directory"),
        ("checkpoint_0000001", "directory"),
        ("checkpoint_0000002", "directory"),
        ("checkpoint_0000003", "link"),  # a link is not a directory, never followed
    ]
    assert stats == []
    assert storage.list_dir("missing") == []
    assert storage.list_dir(".probe-a") == []  # a file lists as empty, as before
