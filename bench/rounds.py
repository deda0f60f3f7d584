"""What each rank runs: interleaved rounds of our save/load and their baselines.

Every function here is called on every rank of a spawned gloo group (see
:mod:`bench.spawn`) and works only under the directory it is given. Every timed
operation starts and ends with a barrier, so a time is the slowest rank's; rank 0
returns the raw samples (seconds, bytes) and :mod:`bench.metrics` turns them into
ratios. Round 0 of the save rounds is the warm-up and is kept apart from the
steady-state rounds.
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch

from bench import disk
from bench.fsdp_state import build_trained, full_state, local_tensor_bytes, sharded_state
from bench.memory import PeakRss

SAVED_STEP = 1
"""The step of every checkpoint the load and reshard rounds read."""


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

    Empties ``work`` (a directory of its own) after every round.
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
                _remove(os.path.join(work, name))
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
    """Save once, then ``rounds`` rounds of cold {ours load, dd read of the same shard files}.

    Self-contained: the checkpoint is written here (seed-0 state, ``world`` ranks)
    under ``work``, then loaded into a state built from another seed, which is
    zeroed before every load; at the end the loaded values must equal the saved ones.
    """
    import ckpt
    from ckpt.format.layout import checkpoint_dirname, shard_filename

    root = os.path.join(work, "ckpt")
    ckpt_dir = os.path.join(root, checkpoint_dirname(SAVED_STEP))
    saved_digest = _save_seed0(root, width)
    model, optim = build_trained(width, seed=1)  # other values: all must come from the checkpoint
    state = sharded_state(model, optim)
    files = disk.files_under(ckpt_dir)
    total_bytes = sum(os.path.getsize(p) for p in files)
    my_shard = os.path.join(ckpt_dir, shard_filename(rank))
    shard_bytes = sum(dist_all_gather(os.path.getsize(my_shard)))

    samples: dict[str, list[float]] = {"cold_ours": [], "cold_dd": []}
    ours_read: list[int] = []
    methods: set[str] = set()

    def cold_ours() -> None:
        _zero(state)
        methods.add(_drop_cache(rank, files))
        got: list[Any] = []
        samples["cold_ours"].append(_timed(lambda: got.append(ckpt.load(state, root))))
        ours_read.append(sum(dist_all_gather(got[0].bytes_read)))

    def cold_dd() -> None:
        methods.add(_drop_cache(rank, files))
        samples["cold_dd"].append(_timed(lambda: disk.dd_read(my_shard)))

    ckpt.load(state, root)  # warm-up of the load path (imports, the checkpoint group)
    for i in range(rounds):
        for op in _rotated([cold_ours, cold_dd], i):
            op()
    _check_digest(state, saved_digest, rank, f"{world} -> {world} load")
    return {
        "times": samples,
        "total_bytes": total_bytes,
        "shard_bytes": shard_bytes,
        "ours_bytes_read": ours_read,
        "cache_drop": sorted(methods - {""}),
        "world": world,
    }


def reshard_save(rank: int, world: int, root: str, width: int) -> dict[str, Any]:
    """Write the checkpoint the reshard loads read: seed-0 state saved from ``world`` ranks."""
    from ckpt.format.layout import checkpoint_dirname

    digest = _save_seed0(root, width)
    files = disk.files_under(os.path.join(root, checkpoint_dirname(SAVED_STEP)))
    return {
        "world": world,
        "checkpoint_bytes": sum(os.path.getsize(p) for p in files),
        "digest": digest,
    }


def reshard_load(
    rank: int, world: int, root: str, width: int, saved_digest: dict[str, str]
) -> dict[str, Any]:
    """One cold, timed ``ckpt.load`` of the checkpoint under ``root`` into ``world`` ranks.

    The state (FSDP2, same width, another seed) is built first and loaded once
    untimed (imports, the checkpoint group); then it is zeroed, the page cache is
    dropped and barrier -> load -> barrier is timed. The loaded values must equal
    the saved ones (``saved_digest``, from :func:`reshard_save`).
    """
    import ckpt
    from ckpt.format.layout import checkpoint_dirname

    files = disk.files_under(os.path.join(root, checkpoint_dirname(SAVED_STEP)))
    model, optim = build_trained(width, seed=1)
    state = sharded_state(model, optim)
    ckpt.load(state, root)
    _zero(state)
    method = _drop_cache(rank, files)
    got: list[Any] = []
    load_s = _timed(lambda: got.append(ckpt.load(state, root)))
    bytes_read = sum(dist_all_gather(got[0].bytes_read))
    _check_digest(state, saved_digest, rank, f"load into {world} ranks")
    return {"world": world, "load_s": load_s, "bytes_read": bytes_read, "cache_drop": method}


def _save_seed0(root: str, width: int) -> dict[str, str]:
    """``ckpt.save`` the seed-0 state under ``root``; its digest (rank 0; {} elsewhere)."""
    import ckpt

    model, optim = build_trained(width, seed=0)
    state = sharded_state(model, optim)
    digest = state_digest(state)
    ckpt.save(state, root, SAVED_STEP)
    del model, optim, state
    gc.collect()
    return digest


def _drop_cache(rank: int, files: list[str]) -> str:
    """Rank 0 evicts ``files`` from the page cache, then all wait; the method (rank 0)."""
    import torch.distributed as dist

    method = disk.drop_page_cache(files) if rank == 0 else ""
    dist.barrier()
    return method


def _zero(state: Any) -> None:
    """Zero every tensor this rank holds in ``state`` (DTensors: the local shard), in place."""
    from torch.distributed.tensor import DTensor

    for _path, value in _leaves(state):
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            with torch.no_grad():
                value.zero_()


def _leaves(obj: Any, path: str = "") -> list[tuple[str, Any]]:
    """``(dotted path, value)`` of every non-container in nested dicts/lists, in order."""
    if isinstance(obj, dict):
        children = [(f"{path}.{k}" if path else str(k), v) for k, v in obj.items()]
    elif isinstance(obj, list | tuple):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    else:
        return [(path, obj)]
    return [leaf for child_path, child in children for leaf in _leaves(child, child_path)]


def state_digest(state: Any) -> dict[str, str]:
    """sha256 of every full tensor in ``state`` (repr for other values); collective.

    Independent of the world size and of how tensors are sharded, so a state saved
    from N ranks and loaded into M compares exactly. Rank 0 gets the digest; the
    other ranks take part in the gathers and get ``{}``.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    out: dict[str, str] = {}
    for path, value in _leaves(state):
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if rank != 0:
            continue
        if isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            sha = hashlib.sha256(flat.numpy()).hexdigest()
            out[path] = f"{value.dtype} {list(value.shape)} {sha}"
        else:
            out[path] = repr(value)
    return out


def _check_digest(state: Any, want: dict[str, str], rank: int, what: str) -> None:
    """Raise on rank 0 if the loaded ``state`` differs from the saved one; collective."""
    got = state_digest(state)
    if rank != 0:
        return
    if not want:
        raise RuntimeError(f"{what}: no digest of the saved state to compare with")
    bad = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} value(s) differ from what was saved: {bad[:5]}")


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
