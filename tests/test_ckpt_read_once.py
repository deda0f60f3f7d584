"""Replicated state read once (ckpt/loading/read_once.py): what every rank loads is fetched
by one rank and broadcast, still checked against its crc32c on every rank.

Real gloo ranks: the bytes each rank read from storage add up to the checkpoint's once
(not once per rank), the values are bitwise the saved ones, a damaged item fails every
rank alike and the load falls back, a rank whose read fails leaves no rank waiting, and
the planning (which items, which reader) is pure and balanced.
"""

from __future__ import annotations

import os

import pytest
import torch

import ckpt
from ckpt.loading.read_once import plan_shared_reads
from ckpt.loading.reader import coalesce_extents
from ckpt.storage import StorageOptions
from testing.spawn import run_ok, run_ranks

pytestmark = pytest.mark.timeout(180)

WIDTH = 256


def replicated_state(step: int) -> dict:
    """What DDP keeps on every rank: the same values everywhere (seeded by the step)."""
    gen = torch.Generator().manual_seed(step)
    return {
        "model": {f"layer{i}.weight": torch.randn(WIDTH, WIDTH, generator=gen) for i in range(8)},
        "extra": {"tokens_seen": step * 1000, "names": ["a", "b"]},
        "step": torch.tensor(step),
    }


def blank() -> dict:
    return {
        "model": {f"layer{i}.weight": torch.zeros(WIDTH, WIDTH) for i in range(8)},
        "extra": {"tokens_seen": -1, "names": []},
        "step": torch.tensor(-1),
    }


def save_worker(rank: int, world: int, root: str, steps: list[int]) -> None:
    for step in steps:
        ckpt.save(replicated_state(step), root, step)


def load_worker(rank: int, world: int, root: str, read_once: bool | None) -> dict:
    state = blank()
    result = ckpt.load(state, root, storage_options=StorageOptions(read_once=read_once))
    expected = replicated_state(result.step)
    for name, value in expected["model"].items():
        assert torch.equal(state["model"][name], value), name
    assert state["extra"] == expected["extra"] and int(state["step"]) == result.step
    return {
        "step": result.step,
        "bytes_read": result.bytes_read,
        "skipped": [(s.step, s.path) for s in result.skipped],
    }


def checkpoint_bytes(root: str) -> int:
    info = ckpt.find_latest_committed(root)
    return sum(f.size for f in info.manifest.files if f.path.endswith(".distcp"))


@pytest.mark.parametrize("world", [2, 3])
def test_replicated_state_is_read_from_storage_once_in_all_and_loads_bitwise(tmp_path, world):
    root = str(tmp_path / "ckpt")
    run_ok(save_worker, world, root, [5], timeout_s=120)
    shards = checkpoint_bytes(root)
    once = run_ok(load_worker, world, root, True, timeout_s=120)
    each = run_ok(load_worker, world, root, False, timeout_s=120)
    assert {r["step"] for r in once + each} == {5}
    read_once_total = sum(r["bytes_read"] for r in once)
    read_each_total = sum(r["bytes_read"] for r in each)
    # every rank reads the whole replicated state without it; with it, the shards once
    # (plus .metadata, read by every rank either way)
    assert read_each_total >= world * shards
    assert read_once_total <= shards * 1.05 + world * 64 * 1024, (read_once_total, shards)
    assert min(r["bytes_read"] for r in once) > 0 or world > 2  # the readers take turns


def test_local_roots_read_each_by_default_and_object_stores_read_once(tmp_path):
    root = str(tmp_path / "ckpt")
    run_ok(save_worker, 2, root, [3], timeout_s=120)
    shards = checkpoint_bytes(root)
    default = run_ok(load_worker, 2, root, None, timeout_s=120)
    assert sum(r["bytes_read"] for r in default) >= 2 * shards  # local: the page cache


def test_read_once_on_an_object_store_by_default(s3_server, s3_root):
    from testing.s3_server import s3_env

    env = s3_env(s3_server.endpoint)
    run_ok(save_worker, 2, s3_root, [4], timeout_s=120, env=env)
    shards = checkpoint_bytes(s3_root)
    loaded = run_ok(load_worker, 2, s3_root, None, timeout_s=120, env=env)
    assert sum(r["bytes_read"] for r in loaded) <= shards * 1.05 + 2 * 64 * 1024


def test_a_damaged_replicated_item_fails_every_rank_alike_and_the_load_falls_back(tmp_path):
    root = str(tmp_path / "ckpt")
    run_ok(save_worker, 2, root, [1, 2], timeout_s=120)
    shard = os.path.join(root, "checkpoint_0000002", "rank_00000.distcp")
    with open(shard, "r+b") as f:  # a flipped byte in the middle of the replicated weights
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    loaded = run_ok(load_worker, 2, root, True, timeout_s=120)
    assert [r["step"] for r in loaded] == [1, 1]
    assert [r["skipped"] for r in loaded] == [[(2, "rank_00000.distcp")]] * 2


def failing_reader_worker(rank: int, world: int, root: str) -> str:
    # rank 0's reads of the shared spans fail for good; nobody may be left waiting
    if rank == 0:

        def broken(self, key, start, into, *, phase="read"):
            raise ckpt.errors.StoragePermanentError(f"{key}: injected: the disk is gone")

        ckpt.storage.Storage.read_range_into = broken
    try:
        ckpt.load(blank(), root, step=1, storage_options=StorageOptions(read_once=True))
    except ckpt.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_a_rank_whose_read_fails_leaves_no_rank_waiting(tmp_path):
    root = str(tmp_path / "ckpt")
    run_ok(save_worker, 2, root, [1], timeout_s=120)
    outcomes = run_ranks(failing_reader_worker, 2, root, timeout_s=60, pg_timeout_s=30)
    assert [o.exitcode for o in outcomes] == [0, 0], [o.error for o in outcomes]
    # every rank reports the reader's own error (DCP gathers each rank's failure)
    for outcome in outcomes:
        assert "injected: the disk is gone" in outcome.result, outcome.result


# -- the planning, pure ------------------------------------------------------------------


class Item:
    def __init__(self, path: str, offset: int, length: int) -> None:
        self.extent = (path, offset, length)


class Plan:
    def __init__(self, items: list[Item]) -> None:
        self.items = items


def test_only_items_every_rank_loads_are_shared_and_readers_are_balanced_by_bytes():
    common = [Item("rank_00000.distcp", i * 100, 100) for i in range(6)]
    only_0 = Item("rank_00001.distcp", 0, 50)
    plans = [Plan([*common, only_0]), Plan(common), Plan(list(reversed(common)))]
    shared = plan_shared_reads(
        plans, lambda item: item.extent, lambda ext: coalesce_extents(ext, 200)
    )
    assert shared is not None
    assert shared.members == {("rank_00000.distcp", i * 100) for i in range(6)}
    assert [(s[1], s[2]) for s in shared.spans] == [(0, 200), (200, 400), (400, 600)]
    assert sorted(s[3] for s in shared.spans) == [0, 1, 2]  # one span per rank
    assert plan_shared_reads(plans[:1], lambda i: i.extent, lambda e: []) is None
    disjoint = [Plan([Item("a", 0, 10)]), Plan([Item("b", 0, 10)])]
    assert plan_shared_reads(disjoint, lambda i: i.extent, lambda e: []) is None
