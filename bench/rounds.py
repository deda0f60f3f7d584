"""What each rank runs: interleaved rounds of our save/load and their baselines.

Both functions are called on every rank of a spawned gloo group (see
:mod:`bench.spawn`). Every timed operation starts and ends with a barrier, so a
time is the slowest rank's; rank 0 returns the raw samples (seconds, bytes) and
:mod:`bench.metrics` turns them into ratios. Round 0 of the save rounds is the
warm-up and is kept apart from the steady-state rounds.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch

from bench import disk
from bench.fsdp_state import (
    LAYERS,
    build_trained,
    full_state,
    local_tensor_bytes,
    sharded_state,
)
from bench.memory import PeakRss

LAST = LAYERS - 1


def _timed(fn: Callable[[], Any]) -> float:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - started


def _rotated(ops: list[str], i: int) -> list[str]:
    k = i % len(ops)
    return ops[k:] + ops[:k]


def save_rounds(rank: int, world: int, work: str, width: int, rounds: int) -> dict[str, Any]:
    """``rounds`` + 1 rounds of {ours, dcp, dd, torch.save}, order rotating per round.

    Keeps the last round's ``ckpt`` checkpoint under ``work/ours_last`` for the
    load rounds; deletes everything else as it goes.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckpt

    model, optim = build_trained(width)
    state = sharded_state(model, optim)
    my_bytes = local_tensor_bytes(state)
    full = full_state(model, optim) if rank == 0 else None
    if rank != 0:
        full_state(model, optim)  # collective; rank 1 drops its copy
    full_bytes = local_tensor_bytes(full) if full is not None else 0

    samples: dict[str, list[float]] = {"ours": [], "dcp": [], "dd": [], "torch_save": []}
    mem_growth: list[int] = []
    ours_bytes: list[int] = []
    dd_bytes: list[int] = []

    def ours(i: int) -> None:
        root = os.path.join(work, f"ours_{i}")
        events: list[dict[str, Any]] = []
        with PeakRss() as peak:
            samples["ours"].append(
                _timed(lambda: ckpt.save(state, root, 1, on_event=events.append))
            )
        mem_growth.append(peak.growth)
        ours_bytes.append(int(events[0]["bytes"]))

    def dcp_save(i: int) -> None:
        path = os.path.join(work, f"dcp_{i}")
        samples["dcp"].append(_timed(lambda: dcp.save(state, checkpoint_id=path)))

    def dd(i: int) -> None:
        path = os.path.join(work, f"dd_{i}_rank{rank}")
        written: list[int] = []
        samples["dd"].append(_timed(lambda: written.append(disk.dd_write(path, my_bytes))))
        dd_bytes.append(sum(dist_all_gather(written[0])))

    def torch_save(i: int) -> None:
        path = os.path.join(work, f"torch_save_{i}.pt")

        def write() -> None:
            if rank == 0:
                torch.save(full, path)
                disk.fsync_file(path)

        samples["torch_save"].append(_timed(write))

    ops = {"ours": ours, "dcp": dcp_save, "dd": dd, "torch_save": torch_save}
    for i in range(rounds + 1):
        for name in _rotated(list(ops), i):
            ops[name](i)
        dist.barrier()
        if rank == 0:
            for name in os.listdir(work):
                if name != f"ours_{i}":
                    _remove(os.path.join(work, name))
        dist.barrier()
    if rank == 0:
        os.replace(os.path.join(work, f"ours_{rounds}"), os.path.join(work, "ours_last"))
    dist.barrier()

    all_growth = dist_all_gather(mem_growth)
    all_state_bytes = dist_all_gather(my_bytes)
    return {
        "times": samples,
        "ours_bytes": ours_bytes,
        "dd_bytes": dd_bytes,
        "full_bytes": full_bytes,
        "rank_state_bytes": all_state_bytes,
        "rank_mem_growth": all_growth,
        "world": world,
    }


def load_rounds(rank: int, world: int, work: str, width: int, rounds: int) -> dict[str, Any]:
    """Cold: {ours load, dd read of the same shard files}; warm: {same-world, 2 -> 1 load}.

    The 2 -> 1 (resharding) load runs on rank 0 alone, in a one-rank group, into
    a full (unsharded) copy of the state: the layout a world-1 job would hold.
    """
    import torch.distributed as dist

    import ckpt
    from ckpt.layout import checkpoint_dirname, shard_filename

    root = os.path.join(work, "ours_last")
    ckpt_dir = os.path.join(root, checkpoint_dirname(1))
    model, optim = build_trained(width, seed=1)  # other values: all must come from the checkpoint
    state = sharded_state(model, optim)
    full = full_state(model, optim) if rank == 0 else None
    if rank != 0:
        full_state(model, optim)
    solo = dist.new_group([0])
    files = disk.files_under(ckpt_dir)
    total_bytes = sum(os.path.getsize(p) for p in files)
    my_shard = os.path.join(ckpt_dir, shard_filename(rank))
    shard_bytes = sum(dist_all_gather(os.path.getsize(my_shard)))

    samples: dict[str, list[float]] = {
        "cold_ours": [],
        "cold_dd": [],
        "warm_same": [],
        "reshard": [],
    }
    ours_read: list[int] = []
    methods: set[str] = set()

    def drop() -> None:
        if rank == 0:
            methods.add(disk.drop_page_cache(files))
        dist.barrier()

    def cold_ours() -> None:
        drop()
        got: list[Any] = []
        samples["cold_ours"].append(_timed(lambda: got.append(ckpt.load(state, root))))
        ours_read.append(sum(dist_all_gather(got[0].bytes_read)))

    def cold_dd() -> None:
        drop()
        samples["cold_dd"].append(_timed(lambda: disk.dd_read(my_shard)))

    def warm_same() -> None:
        samples["warm_same"].append(_timed(lambda: ckpt.load(state, root)))

    def reshard() -> None:
        def load_alone() -> None:
            if rank == 0:
                ckpt.load(full, root, process_group=solo)

        samples["reshard"].append(_timed(load_alone))

    warm_same()  # warm-up of the load path (imports, the checkpoint group)
    reshard()
    samples["warm_same"].clear()
    samples["reshard"].clear()
    for i in range(rounds):
        for op in _rotated([cold_ours, cold_dd], i):
            op()
        for op in _rotated([warm_same, reshard], i):
            op()
    _check_loaded(state, full, width, rank)
    return {
        "times": samples,
        "total_bytes": total_bytes,
        "shard_bytes": shard_bytes,
        "ours_bytes_read": ours_read,
        "cache_drop": sorted(methods),
    }


def _check_loaded(
    state: dict[str, Any], full: dict[str, Any] | None, width: int, rank: int
) -> None:
    """Loaded values equal the saved ones (rebuilt from seed 0), in both layouts."""
    from torch.distributed.tensor import DTensor

    model, optim = build_trained(width, seed=0)
    expected = sharded_state(model, optim)
    for key in ("0.weight", f"{LAST}.bias"):
        want = expected["model"][key]
        got = state["model"][key]
        want_local = want.to_local() if isinstance(want, DTensor) else want
        got_local = got.to_local() if isinstance(got, DTensor) else got
        if not torch.equal(want_local, got_local):
            raise RuntimeError(f"rank {rank}: model.{key} differs from what was saved")
        if full is not None and not torch.equal(full["model"][key][: len(want_local)], want_local):
            raise RuntimeError(f"rank {rank}: resharded model.{key} differs from what was saved")


def dist_all_gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)
