"""The memory tier of CheckpointManager (``memory_every``): snapshots in node memory.

Every test trains an FSDP2 model on 2 spawned ranks with the memory tier on, then resumes
in fresh processes (what torchrun does after a failure) and checks which tier and step
the resume took, and that the parameters and optimizer state are bitwise the saved ones.
A "node" is a memory directory (``CKPT_MEMORY_DIR``): both ranks in one directory is one
node (no replicas), one directory per rank is two nodes (each holds the other's replica).
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

import ckpt
import elastic
from ckpt.loading import reader as reader_mod
from testing.spawn import run_ok

pytestmark = pytest.mark.timeout(300)

GLOBAL_BATCH = 8


def _build(seed: int = 0):
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    sampler = elastic.ElasticSampler(1000, GLOBAL_BATCH, seed=3)
    # "tag" (a plain value) grows every step: its encoding changes length, which moves
    # the items after it in a snapshot's file (the layout is kept, offsets are re-sent).
    return {"model": model, "optim": optim, "sched": sched, "sampler": sampler, "tag": ""}


def _train_step(state) -> None:
    model, optim, sched, sampler = state["model"], state["optim"], state["sched"], state["sampler"]
    ids = torch.as_tensor(sampler.local_batch_ids())
    x = torch.sin(ids[:, None].float() * torch.arange(1, 7).float())
    (model(x).pow(2).sum() / GLOBAL_BATCH).backward()
    optim.step()
    optim.zero_grad()
    sched.step()
    sampler.advance()
    state["tag"] += "s"


def _full(state) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor, gathered in full (collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    out = {
        f"model.{k}": v.clone()
        for k, v in get_model_state_dict(state["model"], options=opts).items()
    }
    optim = get_optimizer_state_dict(state["model"], state["optim"], options=opts)
    for fqn, per_param in optim["state"].items():
        for key, value in per_param.items():
            out[f"optim.{fqn}.{key}"] = value.clone()
    return out


def _node_dir(memory: str | list[str], rank: int) -> str:
    return memory if isinstance(memory, str) else memory[rank]


def _train(rank: int, world: int, root: str, memory, steps: int, every: int, memory_every: int):
    """Train ``steps`` steps, saving durably every ``every`` and in memory every ``memory_every``;
    returns the full state after each step."""
    os.environ["CKPT_MEMORY_DIR"] = _node_dir(memory, rank)
    state = _build()
    manager = ckpt.CheckpointManager(root, state, every=every, memory_every=memory_every)
    assert manager.resume() is None
    history = {}
    for step in range(1, steps + 1):
        _train_step(state)
        manager.maybe_save(step)
        history[step] = _full(state)
    replans = manager.tier("memory").memory.replan_count
    manager.close()
    return {"history": history, "replans": replans, "cursor": state["sampler"].cursor}


def _resume(
    rank: int, world: int, root: str, memory, memory_every: int = 1, chunk_bytes: int | None = None
):
    os.environ["CKPT_MEMORY_DIR"] = _node_dir(memory, rank)
    if chunk_bytes is not None:  # many small messages: the chunked transfer's edges
        from ckpt.tiers.memory import restore as memory_restore

        memory_restore.CHUNK_BYTES = chunk_bytes
    events: list[tuple[str, int, dict]] = []
    state = _build(seed=7)  # other weights: the resume must overwrite them
    manager = ckpt.CheckpointManager(
        root,
        state,
        memory_every=memory_every,
        on_event=lambda name, step, **f: events.append((name, step, f)),
    )
    step = manager.resume()
    info = manager.last_resume
    out = {
        "step": step,
        "tier": info.tier if info else None,
        "full": _full(state),
        "cursor": state["sampler"].cursor,
        "tag": state["tag"],
        "last_lr": state["sched"].get_last_lr(),
        "events": events,
        "old_world": info.old_world_size if info else None,
        "transfer": dict(manager.tier("memory").memory.last_restore),
        "local_bytes": _local_tensor_bytes(state),
    }
    manager.close()
    return out


def _local_tensor_bytes(state) -> int:
    """Bytes of this rank's shards of the parameters and of AdamW's moments."""
    from torch.distributed.tensor import DTensor

    total = 0
    for param in state["model"].parameters():
        total += param.to_local().numel() * param.element_size()
        for key in ("exp_avg", "exp_avg_sq"):
            moment = state["optim"].state[param][key]
            local = moment.to_local() if isinstance(moment, DTensor) else moment
            total += local.numel() * local.element_size()
    return total


def _event(events, name):
    found = [fields | {"step": step} for n, step, fields in events if n == name]
    assert found, f"no {name} event in {[n for n, _, _ in events]}"
    return found[-1]


def _assert_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _slot_of(node_dir: str, holder: int, step: int) -> str:
    for commit in glob.glob(f"{node_dir}/*/h{holder:05d}/slot*/COMMIT"):
        with open(commit) as f:
            if json.load(f)["step"] == step:
                return os.path.dirname(commit)
    raise AssertionError(f"no committed slot of step {step} for holder {holder} under {node_dir}")


def _rank1_weight(slot_dir: str) -> tuple[str, int, int, int]:
    """Rank 1's shard of model.0.weight in a slot: (file, item offset, item length, offset
    of the item's values in the file)."""
    from ckpt.format.tensorblob import data_layout
    from ckpt.loading.reader import load_metadata

    with open(os.path.join(slot_dir, ".metadata"), "rb") as f:
        storage = load_metadata(f.read()).storage_data
    [info] = [
        v
        for k, v in storage.items()
        if k.fqn == "model.0.weight" and v.relative_path == "rank_00001.distcp"
    ]
    path = os.path.join(slot_dir, "rank_00001.distcp")
    with open(path, "rb") as f:
        f.seek(info.offset)
        start, size, _, _ = data_layout(f.read(info.length))
    return path, info.offset, info.length, info.offset + start + size // 2


def _flip_byte(path: str, offset: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def test_resume_takes_the_memory_snapshot_newer_than_the_durable_checkpoint(tmp_path):
    root, memory = str(tmp_path / "ckpt"), str(tmp_path / "node")
    saved = run_ok(_train, 2, root, memory, 7, 4, 1)
    assert saved[0]["replans"] == 1, "every snapshot after the first should reuse the plan"
    got = run_ok(_resume, 2, root, memory)
    for r in got:
        assert (r["step"], r["tier"]) == (7, "memory")
        assert r["cursor"] == saved[0]["cursor"] == 7 * GLOBAL_BATCH
        assert r["tag"] == "s" * 7
    _assert_state(got[0]["full"], saved[0]["history"][7])
    choice = _event(got[0]["events"], "tier_choice")
    assert choice["tier"] == "memory" and "memory step 7 newer than durable 4" in choice["reason"]
    resume = _event(got[0]["events"], "resume")
    assert resume["tier"] == "memory" and resume["step"] == 7
    # Resumed from step 7 again: only that snapshot is kept (both ranks' holders).
    commits = glob.glob(f"{memory}/*/h*/slot*/COMMIT")
    assert len(commits) == 2


def test_a_corrupted_memory_snapshot_is_rejected_and_the_durable_tier_is_used(tmp_path):
    root, memory = str(tmp_path / "ckpt"), str(tmp_path / "node")
    saved = run_ok(_train, 2, root, memory, 6, 4, 2)  # memory 4 and 6, durable 4
    shard = os.path.join(_slot_of(memory, 1, 6), "rank_00001.distcp")
    _flip_byte(shard, os.path.getsize(shard) // 2)
    got = run_ok(_resume, 2, root, memory)
    for r in got:
        assert (r["step"], r["tier"]) == (4, "durable")
    _assert_state(got[0]["full"], saved[0]["history"][4])
    fallback = _event(got[0]["events"], "fallback")
    assert fallback["tier"] == "memory" and fallback["step"] == 6
    assert "rank_00001.distcp" in fallback["reason"] and "crc32c" in fallback["reason"]
    choice = _event(got[0]["events"], "tier_choice")
    assert choice["tier"] == "durable" and "memory step 6 rejected" in choice["reason"]


def test_a_snapshot_without_its_commit_record_is_ignored(tmp_path):
    root, memory = str(tmp_path / "ckpt"), str(tmp_path / "node")
    saved = run_ok(_train, 2, root, memory, 5, 0, 1)  # no durable checkpoint at all
    os.unlink(os.path.join(_slot_of(memory, 1, 5), "COMMIT"))  # rank 1 died before its commit
    got = run_ok(_resume, 2, root, memory)
    for r in got:
        assert (r["step"], r["tier"]) == (4, "memory")
    _assert_state(got[0]["full"], saved[0]["history"][4])
    choice = _event(got[0]["events"], "tier_choice")
    assert "rank_00001.distcp is on no surviving node" in choice["reason"]
    assert "no COMMIT record" in choice["reason"]


def test_a_lost_node_resumes_from_its_peer_replica_on_a_smaller_world(tmp_path):
    root = str(tmp_path / "ckpt")
    nodes = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    saved = run_ok(_train, 2, root, nodes, 5, 0, 1)
    assert os.path.exists(os.path.join(_slot_of(nodes[0], 0, 5), "rank_00001.distcp"))
    import shutil

    shutil.rmtree(nodes[1])  # node 1 is gone, with rank 1's own copy
    got = run_ok(_resume, 1, root, nodes[:1])[0]
    assert (got["step"], got["tier"], got["old_world"]) == (5, "memory", 2)
    _assert_state(got["full"], saved[0]["history"][5])
    assert got["cursor"] == 5 * GLOBAL_BATCH  # the same samples come next


@pytest.mark.parametrize("where", ["file", "values"])
def test_a_corrupted_copy_is_replaced_by_the_replica_on_the_other_node(tmp_path, where):
    """``values``: the byte is in a weight's values, which rank 1 reads from its own copy
    straight into its parameter: the item's crc32c over its parts catches it, and the
    second assembly takes node 0's replica, whose bytes then overwrite what landed there."""
    root = str(tmp_path / "ckpt")
    nodes = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    saved = run_ok(_train, 2, root, nodes, 4, 0, 1)
    own, _, _, in_values = _rank1_weight(_slot_of(nodes[1], 1, 4))
    flipped = in_values if where == "values" else os.path.getsize(own) // 3
    _flip_byte(own, flipped, 0x80)  # rank 1's own copy rots; node 0's is good
    got = run_ok(_resume, 2, root, nodes)
    for r in got:
        assert (r["step"], r["tier"]) == (4, "memory")
    _assert_state(got[0]["full"], saved[0]["history"][4])
    assert not [e for e in got[0]["events"] if e[0] == "fallback"]
    choice = _event(got[0]["events"], "tier_choice")
    assert "rank_00001.distcp" in choice["reason"] and "assembled again" in choice["reason"]
    assert got[1]["transfer"]["received_bytes"] > 0  # the second time, from node 0


def test_an_intact_restore_reads_the_values_straight_into_their_destination(tmp_path):
    """Both nodes intact, same world: each rank copies the values of its own shards from
    the map of its node's copy into its parameters and AdamW state: no buffer, one copy."""
    root = str(tmp_path / "ckpt")
    nodes = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    saved = run_ok(_train, 2, root, nodes, 4, 0, 1)
    got = run_ok(_resume, 2, root, nodes)
    for r in got:
        assert (r["step"], r["tier"]) == (4, "memory")
        assert r["transfer"]["received_bytes"] == 0
        assert r["local_bytes"] <= r["transfer"]["read_in_place_bytes"], r["transfer"]
    _assert_state(got[0]["full"], saved[0]["history"][4])


def test_a_lost_node_at_the_same_world_size_receives_its_shard_in_chunks(tmp_path):
    root = str(tmp_path / "ckpt")
    nodes = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    saved = run_ok(_train, 2, root, nodes, 5, 0, 1)
    import shutil

    shutil.rmtree(nodes[1])  # node 1 comes back empty: rank 1's shard is only on node 0
    got = run_ok(_resume, 2, root, nodes, 1, 200)
    for r in got:
        assert (r["step"], r["tier"], r["old_world"]) == (5, "memory", 2)
        assert r["cursor"] == 5 * GLOBAL_BATCH
    _assert_state(got[0]["full"], saved[0]["history"][5])
    sent, received = got[0]["transfer"], got[1]["transfer"]
    assert received["received_bytes"] > 1000 and received["chunks"] > 5, received
    assert sent["sent_bytes"] == received["received_bytes"] and sent["received_bytes"] == 0
    # The values of rank 1's shards went straight into its parameters and AdamW state
    # (no buffer, no copy); only the items' headers (and the step scalars) did not.
    assert got[1]["local_bytes"] <= received["placed_bytes"] < received["received_bytes"]
    assert sent["placed_bytes"] == 0
    assert not [e for e in got[0]["events"] if e[0] == "fallback"]


@pytest.mark.parametrize("where", ["item", "values"])
def test_a_flipped_byte_in_a_chunk_received_from_the_peer_is_rejected(tmp_path, where):
    """``values``: the byte is in the weight's values, which rank 1 receives straight into
    its parameter: the item's crc32c over its parts catches it, and the durable resume
    then overwrites what landed there."""
    root = str(tmp_path / "ckpt")
    nodes = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    saved = run_ok(_train, 2, root, nodes, 6, 4, 2)  # memory 4 and 6, durable 4
    # node 0 holds rank 1's replica of step 6. Rank 1's own shard of a weight: at the same
    # world size only rank 1 reads it, so these bytes travel to it over gloo; with
    # 200-byte chunks the flip is past the first.
    path, offset, length, in_values = _rank1_weight(_slot_of(nodes[0], 0, 6))
    flipped = in_values if where == "values" else offset + length // 2
    assert flipped > 200
    _flip_byte(path, flipped)
    import shutil

    shutil.rmtree(nodes[1])
    got = run_ok(_resume, 2, root, nodes, 1, 200)
    for r in got:
        assert (r["step"], r["tier"]) == (4, "durable")
    _assert_state(got[0]["full"], saved[0]["history"][4])
    choice = _event(got[0]["events"], "tier_choice")
    # The load caught it (item crc32c), the check of every copy then found no good one.
    assert "a copy failed its check" in choice["reason"] and "crc32c" in choice["reason"]
    fallback = _event(got[1]["events"], "fallback")
    assert fallback["tier"] == "memory" and fallback["step"] == 6
    assert "no copy of rank_00001.distcp verifies" in fallback["reason"]


def test_a_chunk_is_waited_for_once_and_only_when_a_read_covers_it():
    from ckpt.tiers.memory import fs as memory_fs

    class Work:
        def __init__(self, fail: bool = False) -> None:
            self.waits, self.fail = 0, fail

        def wait(self) -> bool:
            self.waits += 1
            if self.fail:
                raise RuntimeError("connection reset by peer")
            return True

    buf = torch.arange(100, dtype=torch.uint8)
    piece = memory_fs.Arriving(1000, buf, "rank_00001.distcp from rank 0")
    works = [Work(), Work(fail=True), Work()]
    for i, work in enumerate(works):
        piece.add(1000 + 40 * i, min(1100, 1040 + 40 * i), work)
    f = memory_fs.PiecesFile(2000, [piece])
    assert bytes(f.read(1000, 1010)) == bytes(range(10))
    assert [w.waits for w in works] == [1, 0, 0]
    assert bytes(f.read(1000, 1040)) == bytes(range(40))
    assert [w.waits for w in works] == [1, 0, 0]  # never twice (gloo would hang)
    with pytest.raises(OSError, match=r"bytes \[1040, 1080\) from rank_00001.distcp from rank 0"):
        f.read(1030, 1050)
    with pytest.raises(OSError, match="connection reset"):
        f.read(1045, 1046)  # the failure stays
    assert bytes(f.read(1080, 1100)) == bytes(range(80, 100))
    assert [w.waits for w in works] == [1, 1, 1]
    with pytest.raises(FileNotFoundError):
        f.read(990, 1010)  # not shipped: never other bytes
    assert piece.settle() is not None
    f.close()
    assert [w.waits for w in works] == [1, 1, 1]


def test_sends_are_posted_in_order_off_the_loading_thread_and_each_waited_once(monkeypatch):
    import threading
    import types

    from ckpt.tiers.memory import restore

    posted: list[tuple[int, int, str]] = []
    waits: list[int] = []

    class Work:
        def __init__(self, tag: int) -> None:
            self.tag = tag

        def wait(self) -> bool:
            waits.append(self.tag)
            if self.tag == 2:
                raise RuntimeError("connection reset by peer")
            return True

    def isend(data, dst, group, tag):
        posted.append((dst, tag, threading.current_thread().name))
        if tag == 4:
            raise RuntimeError("gloo: peer closed")
        return Work(tag)

    monkeypatch.setattr(restore, "dist", types.SimpleNamespace(isend=isend))
    data = torch.zeros(4, dtype=torch.uint8)
    sender = restore._Sender("group", [(data, 1, tag) for tag in (1, 2, 3, 4, 5)])
    error = sender.settle()
    assert [(d, t) for d, t, _ in posted] == [(1, 1), (1, 2), (1, 3), (1, 4)]  # stops at a failure
    assert {name for _, _, name in posted} == {"ckptmem-send"}  # not the loading thread
    assert waits == [1, 2, 3]  # every posted send waited once
    assert error is not None and "peer closed" in error  # the posting error first
    assert sender.settle() is None and waits == [1, 2, 3]  # nothing waited twice


def test_closing_a_file_waits_for_every_chunk_still_arriving():
    from ckpt.tiers.memory import fs as memory_fs

    class Work:
        waits = 0

        def wait(self) -> bool:
            self.waits += 1
            return True

    piece = memory_fs.Arriving(0, torch.zeros(30, dtype=torch.uint8), "x")
    works = [Work(), Work(), Work()]
    for i, work in enumerate(works):
        piece.add(10 * i, 10 * i + 10, work)
    f = memory_fs.PiecesFile(30, [piece])
    f.read(0, 5)
    f.close()  # the buffer may go only when gloo no longer writes into it
    assert [w.waits for w in works] == [1, 1, 1]


_FRESH_PROCESS_READ = """
import fsspec
import ckpt, ckpt.manager, ckpt.tiers.memory
from ckpt.tiers.memory import fs
assert fs.PROTOCOL not in fsspec.registry, "ckptmem:// registered at import"
url = fs.register("k1", {"d/manifest.json": fs.BytesFile(b"{}"), "d/x": fs.BytesFile(b"abc")})
assert fsspec.registry[fs.PROTOCOL] is fs.SnapshotFileSystem
with fsspec.open(url + "/d/x", "rb") as f:
    assert f.read() == b"abc"
assert fsspec.filesystem(fs.PROTOCOL).cat_file(url + "/d/x", 1, 3) == b"bc"
fs.install()  # idempotent
fs.release("k1")
print("ok")
"""


def test_the_snapshot_filesystem_is_registered_on_first_use_not_at_import():
    # A fresh process (what torchrun starts after a failure) that never built a MemoryTier
    # can still read a ckptmem:// root: register() installs the protocol first.
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS_READ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def _durable_only(rank: int, world: int, root: str, memory: str, steps: int):
    """A later attempt without the memory tier: resumes durably, commits ``steps``."""
    os.environ["CKPT_MEMORY_DIR"] = memory
    state = _build()
    manager = ckpt.CheckpointManager(root, state, every=1)
    start = manager.resume()
    for step in range(start + 1, steps + 1):
        _train_step(state)
        manager.maybe_save(step)
    manager.close()
    return start


def test_a_durable_commit_of_a_newer_attempt_fences_an_older_memory_snapshot(tmp_path):
    root, memory = str(tmp_path / "ckpt"), str(tmp_path / "node")
    run_ok(_train, 2, root, memory, 7, 4, 1, env={"TORCHELASTIC_RESTART_COUNT": "0"})
    # Attempt 1 ran without the memory tier from durable 4 and committed step 5.
    starts = run_ok(_durable_only, 2, root, memory, 5, env={"TORCHELASTIC_RESTART_COUNT": "1"})
    assert starts == [4, 4]
    got = run_ok(_resume, 2, root, memory, env={"TORCHELASTIC_RESTART_COUNT": "2"})
    for r in got:
        assert (r["step"], r["tier"]) == (5, "durable")
    choice = _event(got[0]["events"], "tier_choice")
    assert "fenced" in choice["reason"]
    assert not glob.glob(f"{memory}/*/h*/slot*/COMMIT"), "unusable snapshots are removed"


def _finish(rank: int, world: int, root: str, memory: str):
    os.environ["CKPT_MEMORY_DIR"] = memory
    state = _build()
    manager = ckpt.CheckpointManager(root, state, every=0, memory_every=1)
    for step in range(1, 4):
        _train_step(state)
        manager.maybe_save(step, final=step == 3)
    manager.close()


def test_memory_snapshots_are_dropped_once_the_durable_tier_has_caught_up(tmp_path):
    root, memory = str(tmp_path / "ckpt"), str(tmp_path / "node")
    run_ok(_finish, 2, root, memory)
    assert [i.step for i in ckpt.list_checkpoints(root)] == [3]
    assert not glob.glob(f"{memory}/*/h*"), os.listdir(memory)


def test_memory_every_is_validated():
    with pytest.raises(ValueError, match="memory_every"):
        ckpt.CheckpointManager("/tmp/x", {}, memory_every=-1)


def test_only_items_loaded_whole_into_their_own_memory_are_received_in_place(tmp_path):
    import torch.distributed.checkpoint as dcp

    from ckpt.loading.reader import load_metadata
    from ckpt.tiers.memory.restore import _plan_reads

    saved = {"a": torch.randn(4, 3), "b": torch.randn(4, 3), "n": 5}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = load_metadata(f.read())

    def in_place(template) -> set[str]:
        _, whole = _plan_reads(template, metadata)
        return {
            key
            for per in whole.values()
            for off, tensor in per.items()
            for key, value in template.items()
            if isinstance(value, torch.Tensor) and value.data_ptr() == tensor.data_ptr()
        }

    own = {"a": torch.zeros(4, 3), "b": torch.zeros(4, 3), "n": 0}
    assert in_place(own) == {"a", "b"}  # the plain value "n" never is
    tied = torch.zeros(4, 3)  # two items, one memory (tied weights): loaded as usual
    assert in_place({"a": tied, "b": tied, "n": 0}) == set()
    assert in_place({"a": torch.zeros(4, 3).t().contiguous().t(), "b": own["b"], "n": 0}) == {"b"}
    assert in_place({"a": torch.zeros(4, 3, dtype=torch.float64), "b": own["b"], "n": 0}) == {"b"}


def _scattered_load(tmp_path, monkeypatch, *, into_target: bool, flip: bool = False):
    """Load a checkpoint whose weight item is served as three parts (header, values,
    trailer), the values in ``target["w"]`` itself (what a peer restore receives) or in a
    buffer of their own; returns the target and the items the loader decoded."""
    from ckpt.format.layout import checkpoint_dirname
    from ckpt.format.tensorblob import data_layout
    from ckpt.loading.reader import load_metadata
    from ckpt.tiers.memory import fs as memory_fs

    saved = {"w": torch.randn(16, 8), "n": 3}
    root = str(tmp_path / "root")
    ckpt.save(saved, root, 1)
    dirname = checkpoint_dirname(1)
    raw = {}
    for name in os.listdir(os.path.join(root, dirname)):
        with open(os.path.join(root, dirname, name), "rb") as f:
            raw[name] = f.read()
    [info] = [v for k, v in load_metadata(raw[".metadata"]).storage_data.items() if k.fqn == "w"]
    data = raw[info.relative_path]
    start, size, _, _ = data_layout(data[info.offset : info.offset + info.length])
    lo, hi = info.offset + start, info.offset + start + size
    target = {"w": torch.zeros(16, 8), "n": 0}
    values = (
        target["w"].view(-1).view(torch.uint8)
        if into_target
        else torch.empty(size, dtype=torch.uint8)
    )
    values.copy_(torch.frombuffer(bytearray(data[lo:hi]), dtype=torch.uint8))
    if flip:
        values[size // 2] ^= 1
    pieces = [
        memory_fs.Arriving(0, torch.frombuffer(bytearray(data[:lo]), dtype=torch.uint8), "head"),
        memory_fs.Arriving(lo, values, "values"),
        memory_fs.Arriving(hi, torch.frombuffer(bytearray(data[hi:]), dtype=torch.uint8), "tail"),
    ]
    files = {
        f"{dirname}/{n}": memory_fs.BytesFile(b) for n, b in raw.items() if n != info.relative_path
    }
    files[f"{dirname}/{info.relative_path}"] = memory_fs.PiecesFile(
        len(data), pieces, {info.offset: (lo, size)}
    )
    decoded: list[str] = []
    real = reader_mod.ShardReader._deliver
    monkeypatch.setattr(
        reader_mod.ShardReader, "_deliver",
        staticmethod(lambda item, piece, planner: (decoded.append(item.dest_index.fqn), real(item, piece, planner))),
    )  # fmt: skip
    url = memory_fs.register(f"t-{into_target}-{flip}", files)
    try:
        ckpt.load(target, url, step=1, quarantine=False)
    finally:
        memory_fs.release(url.split("://", 1)[1])
    return saved, target, decoded


def test_values_received_into_their_destination_are_checked_and_used_in_place(
    tmp_path, monkeypatch
):
    saved, target, decoded = _scattered_load(tmp_path, monkeypatch, into_target=True)
    assert torch.equal(target["w"], saved["w"]) and target["n"] == 3
    assert decoded == ["n"]  # the weight was committed where it already was


def test_values_in_a_buffer_of_their_own_are_joined_and_loaded_as_usual(tmp_path, monkeypatch):
    saved, target, decoded = _scattered_load(tmp_path, monkeypatch, into_target=False)
    assert torch.equal(target["w"], saved["w"]) and target["n"] == 3
    assert sorted(decoded) == ["n", "w"]


def test_a_flipped_byte_in_values_received_in_place_fails_the_item_check(tmp_path, monkeypatch):
    with pytest.raises(ckpt.CorruptCheckpointError, match="crc32c"):
        _scattered_load(tmp_path, monkeypatch, into_target=True, flip=True)
