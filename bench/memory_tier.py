"""``python -m bench.memory_tier [--quick] [--json OUT] [--dir DIR]``: what the checkpoint
manager's memory tier (``memory_every``) costs while training and what it buys at restart.

Two metrics, each against its baseline measured in the same run, printed as JSON
(``{name: {value, target, ok, detail}}``, the shape of ``python -m bench --json``):

- ``memory_tier_stall`` (target <= 0.02): training time lost to memory snapshots every K
  steps, per step, over the step time. 2 spawned ranks (gloo) train the trainer's tiny GPT
  (``bench/gpt.py``, the plain FSDP2 step) with a ``CheckpointManager(memory_every=K)``
  calling ``maybe_save`` after every step; each rank is its own node (its own
  ``CKPT_MEMORY_DIR``), so every snapshot is also replicated to the peer. Rounds of, for
  each K of ``K_VALUES``, a pair {S steps with snapshots every K, S steps without}, order
  alternating; a side's time runs barrier -> S steps (+ waiting for the last
  replication) -> barrier.
  value, for K = ``HEADLINE_K``: the median time ``maybe_save`` blocks in a snapshot
  (slowest rank) / K / the median step time without snapshots (the replication runs in
  the background). detail has every K, the snapshot's phases, and the end-to-end
  comparisons of the paired rounds: wall time per step and CPU time per step (both ranks,
  every thread, the replication's included), (with - without) / without.
- ``peer_restore_vs_disk`` (target <= 0.5): ``CheckpointManager.resume()`` from the memory
  tier / from the durable tier on local disk, the same state (the FSDP2 MLP + AdamW of
  ``bench/fsdp_state.py``, saved durably at step 1 and in memory at step 2, unchanged in
  between). 2 spawned ranks, one node each; for the memory side node 1's memory
  directory is deleted first (a lost node), so rank 1's shard comes from node 0's replica
  over gloo: the peer restore. The disk side drops the page cache first (cold, like
  ``load_vs_disk``); before each memory restore every node's memory files are copied
  anew from the saved ones, as a save leaves them (:data:`AFTER_DROP`: why, and the one
  peer restore after a drop that the detail reports). Each sample is a fresh pair of
  processes: build the state with another seed, one untimed resume (imports, code
  paths), then the timed one (barrier -> resume -> barrier). detail also has the restore with both nodes intact (a
  killed worker: every shard is on its node), from the first round only the warm disk
  restore and the one from the GCS emulator, and the memory restore's phases; every
  restore is checked against the saved state (sha256).
  What bounds the peer restore, measured in the same processes right after each timed
  peer restore (:func:`transfer_baseline`): one gloo send/recv of the shipped bytes into
  a buffer touched before (the loopback) and into a new one (what a restarted process
  pays), first-touch of a new buffer alone, one copy and one crc32c of those bytes;
  next to them the bytes the receiving rank got and how long its load waited for them.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from bench import disk
from bench.fsdp_state import build_trained, layer_width
from bench.metrics import GROUPS
from bench.metrics import TARGETS as ALL_TARGETS
from bench.spawn import run_on_ranks
from runcore import events as ev

TARGETS = {name: ALL_TARGETS[name] for name in GROUPS["memory"]}
"""This module's two metrics, with the targets of the one table (:data:`bench.metrics.TARGETS`)."""
K_VALUES = (1, 5)
"""The snapshot intervals of memory_tier_stall: every step (the worst case) and the headline's."""
HEADLINE_K = 5
RANKS = 2
CORE_SIDES = ("memory_peer", "disk_cold", "memory_intact")
"""The restores of every round of peer_restore_vs_disk: its two sides and the intact one."""
AFTER_DROP = "memory_peer_after_drop"
"""One peer restore after the rounds, from node 0's files right after a page-cache drop
(detail only). A drop (``drop_caches``, or ``POSIX_FADV_DONTNEED`` on the files) cannot
evict a tmpfs page, but it marks each one ``PG_reclaim``, which the kernel reads as
``PG_readahead``; its fault-around then skips those pages, so every 4 KB page of a map
faults on its own (16x the faults), and the sender's gloo sends from its map cost about
twice the CPU; until the page is written again. A snapshot as a save leaves it (new pages)
has none of that, and a run's memory snapshots get there only if something drops the
caches after they are written; the rounds therefore restore every node's memory files
from a copy before each memory restore, and the disk side's drops do not carry over."""
EXTRA_SIDES = ("disk_warm", "gcs")
"""Restores in the first round only (one sample each, for the detail): the warm disk and,
when fake-gcs-server is here, the emulated object store."""


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    stall_rounds: int
    stall_steps: int
    restore_bytes: int
    restore_rounds: int
    timeout_s: float


QUICK = Mode(
    "quick", stall_rounds=3, stall_steps=10, restore_bytes=64 << 20, restore_rounds=2, timeout_s=300
)
FULL = Mode("full", stall_rounds=5, stall_steps=20, restore_bytes=512 << 20, restore_rounds=3, timeout_s=900)  # fmt: skip


def _node(memory: str, rank: int) -> str:
    return os.path.join(memory, f"node{rank}")


def _max_over_ranks(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# -- memory_tier_stall --------------------------------------------------------------------


def stall_rounds(rank: int, world: int, work: str, memory: str, rounds: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    import ckpt
    from bench.gpt import build_tiny_gpt, plain_step

    torch.set_num_threads(1)  # as under torchrun (OMP_NUM_THREADS=1)
    os.environ["CKPT_MEMORY_DIR"] = _node(memory, rank)
    g = build_tiny_gpt(rank, world)
    state = {"model": g.model, "optim": g.optimizer}
    managers = {
        k: ckpt.CheckpointManager(os.path.join(work, f"stall_k{k}"), state, memory_every=k)
        for k in K_VALUES
    }
    batch = g.layout.global_batch
    cursor, step = 0, 0
    blocking: dict[int, list[float]] = {k: [] for k in K_VALUES}
    phases: dict[int, list[dict[str, float]]] = {k: [] for k in K_VALUES}
    replans = {}

    def run(k: int | None) -> tuple[float, float]:
        """Wall seconds per step (slowest rank) and CPU seconds per step (both ranks, every
        thread: training, gloo, the snapshot's own and the replication thread)."""
        nonlocal cursor, step
        dist.barrier()
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            plain_step(g, cursor)
            cursor += batch
            step += 1
            if k is not None:
                t0 = time.perf_counter()
                managers[k].maybe_save(step)
                snapshots = managers[k].tier("memory")
                if snapshots.policy.should_save(step, final=False):
                    blocking[k].append(time.perf_counter() - t0)
                    tier = snapshots.memory
                    phases[k].append(
                        {"capture_s": blocking[k][-1] - tier.last_snapshot_s, **tier.last_phases}
                    )
        if k is not None:
            managers[k].tier("memory").memory.wait_replication()
        cpu = time.process_time() - cpu
        dist.barrier()
        wall = (time.perf_counter() - started) / steps
        total_cpu = torch.tensor([cpu], dtype=torch.float64)
        dist.all_reduce(total_cpu)
        return wall, float(total_cpu.item()) / steps

    for _ in range(3):  # warm-up; each manager's first snapshot plans its layout
        run(None)
    for k in K_VALUES:
        step = (step // k + 1) * k - 1
        run(k)
    for k in K_VALUES:
        blocking[k].clear()
        phases[k].clear()
    # Each K against a side without snapshots run right before or after it (alternating),
    # so a pair shares the machine's load of the moment.
    per_step: dict[str, list[float]] = {f"{k}{s}": [] for k in K_VALUES for s in ("", "_base")}
    cpu_per_step: dict[str, list[float]] = {key: [] for key in per_step}
    for i in range(rounds):
        for j, k in enumerate(K_VALUES):
            for side in (k, None) if (i + j) % 2 else (None, k):
                wall, cpu = run(side)
                key = str(k) if side is not None else f"{k}_base"
                per_step[key].append(wall)
                cpu_per_step[key].append(cpu)
    for k in K_VALUES:
        replans[k] = managers[k].tier("memory").memory.replan_count
        managers[k].close()
    return {
        "per_step_s": per_step,
        "cpu_per_step_s": cpu_per_step,
        "phases_median_s": {
            k: {n: statistics.median(p[n] for p in v) for n in v[0]} for k, v in phases.items()
        },
        "blocking_s": {
            k: [_max_over_ranks(x) for x in v[: min(len(v) for v in blocking.values())]]
            for k, v in blocking.items()
        },
        "replans": replans,
    }


def stall_metric(raw: dict, mode: Mode) -> dict:
    base = [t for k in K_VALUES for t in raw["per_step_s"][f"{k}_base"]]
    detail: dict[str, Any] = {
        "mode": mode.name,
        "ranks": RANKS,
        "steps_per_side": mode.stall_steps,
        "rounds": mode.stall_rounds,
        "value_is": "blocking_stall of K=5: median time maybe_save spends in a snapshot "
        "(slowest rank) / K / median step time without snapshots. End-to-end cross-checks "
        "over paired rounds: wall_stall (wall time per step, with - without) / without, and "
        "cpu_stall (CPU time per step of both ranks, every thread, the replication's "
        "included); on a shared 2-core machine their round samples spread by +-10-30%",
    }
    values = {}
    for k in K_VALUES:
        pairs = zip(raw["per_step_s"][str(k)], raw["per_step_s"][f"{k}_base"], strict=True)
        walls = [(t - b) / b for t, b in pairs]
        pairs = zip(raw["cpu_per_step_s"][str(k)], raw["cpu_per_step_s"][f"{k}_base"], strict=True)
        cpus = [(t - b) / b for t, b in pairs]
        blocked = raw["blocking_s"][k]
        values[k] = statistics.median(blocked) / k / statistics.median(base)
        detail[f"k{k}"] = {
            "blocking_stall": round(values[k], 4),
            "wall_stall": round(statistics.median(walls), 4),
            "cpu_stall": round(statistics.median(cpus), 4),
            "cpu_round_samples": [round(r, 4) for r in cpus],
            "wall_round_samples": [round(r, 4) for r in walls],
            "step_median_s": round(statistics.median(raw["per_step_s"][str(k)]), 4),
            "snapshot_blocking_median_s": round(statistics.median(blocked), 4),
            "snapshot_phases_median_s": {n: round(v, 4) for n, v in raw["phases_median_s"][k].items()},
            "plans": raw["replans"][k],
        }  # fmt: skip
    detail["step_median_s_without"] = round(statistics.median(base), 4)
    base_cpu = [t for k in K_VALUES for t in raw["cpu_per_step_s"][f"{k}_base"]]
    detail["cpu_per_step_median_s_without"] = round(statistics.median(base_cpu), 4)
    detail["headline_k"] = HEADLINE_K
    return _metric("memory_tier_stall", values[HEADLINE_K], detail)


# -- peer_restore_vs_disk -------------------------------------------------------------------


def restore_save(
    rank: int, world: int, root: str, memory: str, width: int, gcs_root: str | None
) -> dict:
    import ckpt

    os.environ["CKPT_MEMORY_DIR"] = _node(memory, rank)
    model, optim = build_trained(width)
    manager = ckpt.CheckpointManager(root, {"model": model, "optim": optim}, memory_every=2)
    manager.save(1)  # durable, step 1
    manager.maybe_save(2)  # memory tier, step 2: the same state
    manager.close()  # waits for the replication to the other node
    if gcs_root is not None:  # the same state, durable on (emulated) object storage
        remote = ckpt.CheckpointManager(gcs_root, {"model": model, "optim": optim})
        remote.save(1)
        remote.close()
    return {"digest": _digest(model, optim), "bytes": sum(_local_bytes(model, optim))}


def restore_sample(
    rank: int, world: int, root: str, memory: str, width: int, tier: str, baseline: bool = False
) -> dict:
    """One timed resume (after an untimed one) in a fresh pair of processes; with
    ``baseline``, then :func:`transfer_baseline` of the bytes this resume shipped."""
    import torch
    import torch.distributed as dist

    import ckpt

    torch.set_num_threads(1)  # as under torchrun (OMP_NUM_THREADS=1)
    os.environ["CKPT_MEMORY_DIR"] = _node(memory, rank)
    model, optim = build_trained(width, seed=1)
    events: list[tuple[str, dict]] = []
    manager = ckpt.CheckpointManager(
        root,
        {"model": model, "optim": optim},
        memory_every=2 if tier == "memory" else 0,
        on_event=lambda name, step, **f: events.append((name, f)),
    )
    manager.resume()  # untimed: imports and first-call costs
    # As the trainer does after its imports (trainer/__main__.py): the collector stops
    # walking the long-lived objects, so a full collection (~0.2 s with torch loaded)
    # does not land in the timed resume of one side and not the other.
    gc.collect()
    gc.freeze()
    method = None
    if tier.startswith("disk_cold"):
        method = disk.drop_page_cache(disk.files_under(root))
    dist.barrier()
    started = time.perf_counter()
    step = manager.resume()
    dist.barrier()
    elapsed = time.perf_counter() - started
    assert manager.last_resume is not None
    expected = (2, "memory") if tier == "memory" else (1, "durable")
    assert (step, manager.last_resume.tier) == expected, (step, manager.last_resume.tier)
    choice = [f for name, f in events if name == ev.TIER_CHOICE]
    snapshots = manager.tier("memory")
    out = {
        "s": elapsed,
        "digest": _digest(model, optim),
        "cache_drop": method,
        "phases": choice[-1].get("timings") if choice else None,
        "bytes_read": manager.last_resume.bytes_read,
        "transfer": dict(snapshots.memory.last_restore) if snapshots else None,
    }
    manager.close()
    if baseline:
        shipped = [0.0] * world
        dist.all_gather_object(shipped, (out["transfer"] or {}).get("received_bytes", 0.0))
        out["baseline"] = transfer_baseline(rank, shipped.index(max(shipped)), int(max(shipped)))
    return out


def transfer_baseline(rank: int, receiver: int, nbytes: int, reps: int = 3) -> dict:
    """What moving ``nbytes`` from rank 0 to ``receiver`` costs here without the restore,
    in the same processes right after it (collective; every rank calls it):

    - ``gloo_warm_s``: one send/recv over a new gloo group into a buffer the receiver
      touched before (the loopback's own speed);
    - ``gloo_fresh_s``: the same into a newly allocated buffer (what a restarted process
      pays: every page of its receive buffer is touched for the first time);
    - ``first_touch_s``: writing a newly allocated buffer once, alone (page faults);
    - ``copy_s``, ``crc32c_s``: one memory copy and one crc32c of ``nbytes`` (what the
      loader does to each byte it uses).

    Medians of ``reps``; 0 bytes (nothing shipped): empty.
    """
    import torch
    import torch.distributed as dist

    from ckpt.dist import new_checkpoint_group
    from ckpt.format.checksum import crc32c_of

    group = new_checkpoint_group()
    if nbytes <= 0 or receiver == 0:
        return {}
    times: dict[str, list[float]] = {"gloo_warm_s": [], "gloo_fresh_s": [], "first_touch_s": []}
    sender_buf = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else None
    warm = torch.ones(nbytes, dtype=torch.uint8) if rank == receiver else None

    def transfer(buf: Any) -> float:
        dist.barrier(group=group)
        started = time.perf_counter()
        if rank == 0:
            dist.send(sender_buf, receiver, group=group)
        elif rank == receiver:
            dist.recv(buf, 0, group=group)
        dist.barrier(group=group)
        return time.perf_counter() - started

    for _ in range(reps):
        times["gloo_warm_s"].append(transfer(warm))
        fresh = torch.empty(nbytes, dtype=torch.uint8) if rank == receiver else None
        times["gloo_fresh_s"].append(transfer(fresh))
        del fresh
        dist.barrier(group=group)
        started = time.perf_counter()
        if rank == receiver:
            torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        times["first_touch_s"].append(time.perf_counter() - started)
    if rank != receiver:
        return {}
    out = {k: statistics.median(v) for k, v in times.items()}
    other = torch.empty(nbytes, dtype=torch.uint8)
    other.copy_(warm)  # touched once, then timed
    started = time.perf_counter()
    other.copy_(warm)
    out["copy_s"] = time.perf_counter() - started
    started = time.perf_counter()
    crc32c_of(memoryview(warm.numpy()))
    out["crc32c_s"] = time.perf_counter() - started
    return out


def _local_bytes(model: Any, optim: Any) -> list[int]:
    import torch.distributed as dist

    from bench.fsdp_state import local_tensor_bytes, sharded_state

    out = [0] * dist.get_world_size()
    dist.all_gather_object(out, local_tensor_bytes(sharded_state(model, optim)))
    return out


def _digest(model: Any, optim: Any) -> str:
    """sha256 of every full tensor of the state (collective; the same on every rank)."""
    import torch

    from bench.fsdp_state import full_state

    state = full_state(model, optim)
    h = hashlib.sha256()

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for key in sorted(obj, key=str):
                walk(f"{prefix}.{key}", obj[key])
        elif isinstance(obj, torch.Tensor):
            h.update(prefix.encode())
            h.update(obj.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())

    walk("", {"model": state["model"], "optim": state["optim"]["state"]})
    return h.hexdigest()


def restore_rounds(
    work: str,
    memory: str,
    mode: Mode,
    gcs_root: str | None,
    *,
    sides: tuple[str, ...] = CORE_SIDES,
    extras: bool = True,
) -> dict:
    """``mode.restore_rounds`` rounds of the restores of ``sides`` (order rotating), with
    :data:`EXTRA_SIDES` in the first round and the :data:`AFTER_DROP` sample when
    ``extras``; ``{"times": {side: [s, ...]}, ...}``."""
    root = os.path.join(work, "restore")
    width = layer_width(mode.restore_bytes)
    saved = run_on_ranks(
        restore_save, RANKS, root, memory, width, gcs_root, timeout_s=mode.timeout_s
    )[0]
    backups = [os.path.join(memory, f"node{r}-backup") for r in range(RANKS)]
    for r, backup in enumerate(backups):
        shutil.copytree(_node(memory, r), backup)

    def place(side: str) -> None:
        """Each node's memory as the save left it (new tmpfs pages, see
        :data:`AFTER_DROP`); none on node 1 for the peer restore."""
        for r, backup in enumerate(backups):
            shutil.rmtree(_node(memory, r), ignore_errors=True)
            if not (r == 1 and side == "memory_peer"):
                shutil.copytree(backup, _node(memory, r))

    extra = (list(EXTRA_SIDES) if gcs_root is not None else [EXTRA_SIDES[0]]) if extras else []
    times: dict[str, list[float]] = {s: [] for s in sides + tuple(extra)}
    phases: dict[str, list[Any]] = {s: [] for s in times}
    transfers: dict[str, list[Any]] = {"memory_peer": [], "memory_intact": []}
    baselines: list[dict[str, float]] = []
    methods = set()
    for i in range(mode.restore_rounds):
        n = len(sides)
        order = list(sides[i % n :] + sides[: i % n]) + (extra if i == 0 else [])
        for side in order:
            place(side)
            tier = "memory" if side.startswith("memory") else side
            where = gcs_root if side == "gcs" else root
            baseline = extras and side == "memory_peer"
            got = run_on_ranks(restore_sample, RANKS, where, memory, width, tier, baseline,
                               timeout_s=mode.timeout_s)  # fmt: skip
            assert all(g["digest"] == saved["digest"] for g in got), (
                f"{side}: restored state differs"
            )
            times[side].append(got[0]["s"])
            phases[side].append(got[0]["phases"])
            if side in transfers:
                transfers[side].append([g["transfer"] for g in got])
            for g in got:
                if g.get("baseline"):
                    baselines.append(g["baseline"])
            if got[0]["cache_drop"]:
                methods.add(got[0]["cache_drop"])
    if not extras:
        return {"times": times, "bytes": saved["bytes"], "width": width,
                "cache_drop": sorted(methods)}  # fmt: skip
    # One more peer restore, from node 0's files after a cache drop (detail only).
    place("memory_peer")
    methods.add(disk.drop_page_cache(disk.files_under(_node(memory, 0))))
    got = run_on_ranks(restore_sample, RANKS, root, memory, width, "memory",
                       timeout_s=mode.timeout_s)  # fmt: skip
    assert all(g["digest"] == saved["digest"] for g in got), f"{AFTER_DROP}: restored state differs"
    times[AFTER_DROP] = [got[0]["s"]]
    return {"times": times, "phases": phases, "bytes": saved["bytes"], "width": width,
            "cache_drop": sorted(methods), "gcs": gcs_root, "transfers": transfers,
            "baselines": baselines}  # fmt: skip


def restore_metric(raw: dict, mode: Mode) -> dict:
    med = {side: statistics.median(v) for side, v in raw["times"].items()}
    detail = {
        "mode": mode.name,
        "ranks": RANKS,
        "state_bytes": raw["bytes"],
        "memory_peer_median_s": round(med["memory_peer"], 4),
        "disk_cold_median_s": round(med["disk_cold"], 4),
        "memory_intact_median_s": round(med["memory_intact"], 4),
        "disk_warm_median_s": round(med["disk_warm"], 4),
        "intact_vs_disk_cold": round(med["memory_intact"] / med["disk_cold"], 4),
        "peer_vs_disk_warm": round(med["memory_peer"] / med["disk_warm"], 4),
        "samples_s": {k: [round(x, 4) for x in v] for k, v in raw["times"].items()},
        "memory_peer_phases_s": raw["phases"]["memory_peer"][-1],
        "memory_intact_phases_s": raw["phases"]["memory_intact"][-1],
        "cache_drop": raw["cache_drop"],
    }
    if AFTER_DROP in med:  # see AFTER_DROP: not in the value
        detail["peer_after_drop_s"] = round(med[AFTER_DROP], 4)
        detail["peer_after_drop_vs_disk_cold"] = round(med[AFTER_DROP] / med["disk_cold"], 4)
    detail.update(_transfer_detail(raw, med["memory_peer"]))
    if "gcs" in med:
        detail["gcs_emulator_median_s"] = round(med["gcs"], 4)
        detail["peer_vs_gcs_emulator"] = round(med["memory_peer"] / med["gcs"], 4)
        detail["intact_vs_gcs_emulator"] = round(med["memory_intact"] / med["gcs"], 4)
    else:
        detail["gcs_emulator"] = raw.get("gcs_status", "not run")
    return _metric("peer_restore_vs_disk", med["memory_peer"] / med["disk_cold"], detail)


def _transfer_detail(raw: dict, peer_s: float) -> dict:
    """The peer restore's transfer against what this machine can move, same run: the
    receiving rank's bytes and the time its loads waited for them, and the medians of
    :func:`transfer_baseline` (GB/s = bytes / seconds)."""
    samples = raw.get("transfers", {}).get("memory_peer") or []
    per_sample = [max(ranks, key=lambda t: (t or {}).get("received_bytes", 0)) for ranks in samples]
    per_sample = [t for t in per_sample if t and t.get("received_bytes")]
    if not per_sample:
        return {}
    nbytes = statistics.median(t["received_bytes"] for t in per_sample)
    wait = statistics.median(t.get("wait_s", 0.0) for t in per_sample)
    out: dict[str, Any] = {
        "peer_shipped_bytes": int(nbytes),
        "peer_chunks": int(statistics.median(t.get("chunks", 0) for t in per_sample)),
        "peer_load_waited_for_bytes_median_s": round(wait, 4),
        "peer_placed_bytes": int(statistics.median(t.get("placed_bytes", 0) for t in per_sample)),
        "peer_effective_gbps": round(nbytes / peer_s / 1e9, 3),
    }
    base = raw.get("baselines") or []
    if base:
        for key in ("gloo_warm_s", "gloo_fresh_s", "first_touch_s", "copy_s", "crc32c_s"):
            value = statistics.median(b[key] for b in base)
            out[f"baseline_{key}"] = round(value, 4)
            out[f"baseline_{key[:-2]}_gbps"] = round(nbytes / value / 1e9, 3)
        out["bound"] = (
            "the receiving rank's bytes: the values of its tensors (peer_placed_bytes) arrive "
            "straight in the destination tensors, memory the process touched before "
            "(baseline_gloo_warm, not baseline_gloo_fresh), and the loader checks them "
            "(crc32c) as their items complete, overlapped with the arrival of later chunks; "
            "the sender's own load (a check and a copy of its shard) shares the machine's cores"
        )
    return out


@contextlib.contextmanager
def _gcs_emulator() -> Iterator[tuple[str | None, str]]:
    """A gs:// root on fake-gcs-server (in memory) for a comparison, if the binary is here:
    ``(root or None, status)``; the environment variables are set for spawned ranks."""
    from bench.harness.gcs_emulator import create_bucket, emulator_in_environ, start_emulator

    try:
        emulator = start_emulator()
    except Exception as exc:  # no binary, no start: the comparison is skipped
        yield None, f"not run: {type(exc).__name__}: {exc}"
        return
    with emulator_in_environ(emulator):
        create_bucket(emulator.endpoint, "bench")
        yield "gs://bench/memory-tier", "fake-gcs-server, in-memory backend"


# -- driver ---------------------------------------------------------------------------------


def _metric(name: str, value: float, detail: dict) -> dict:
    target, direction = TARGETS[name]
    ok = value <= target if direction == "<=" else value >= target
    return {"value": round(value, 4), "target": target, "ok": bool(ok), "detail": detail}


def measure(work: str, mode: Mode, only: tuple[str, ...] = tuple(TARGETS)) -> dict[str, dict]:
    """The metrics in ``only``; ``work`` holds the durable roots (a disk), memory dirs go
    to /dev/shm (tmpfs, as in production)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else work
    memory = os.path.join(base, f"bench-memory-{uuid.uuid4().hex[:8]}")
    out = {}
    try:
        if "memory_tier_stall" in only:
            stall = run_on_ranks(stall_rounds, RANKS, work, os.path.join(memory, "stall"),
                                 mode.stall_rounds, mode.stall_steps, timeout_s=mode.timeout_s)[0]  # fmt: skip
            out["memory_tier_stall"] = stall_metric(stall, mode)
        if "peer_restore_vs_disk" in only:
            with _gcs_emulator() as (gcs_root, status):
                restore = restore_rounds(work, os.path.join(memory, "restore"), mode, gcs_root)
            restore["gcs_status"] = status
            out["peer_restore_vs_disk"] = restore_metric(restore, mode)
        return out
    finally:
        shutil.rmtree(memory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.memory_tier", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--quick", action="store_true", help="fewer rounds, 64 MB restore state")
    p.add_argument("--json", metavar="OUT", help="also write the JSON here")
    p.add_argument("--dir", default=None, help="parent of the temp dir of the durable roots")
    p.add_argument("--only", choices=sorted(TARGETS), action="append", help="measure only this")
    args = p.parse_args(argv)
    mode = QUICK if args.quick else FULL
    work = tempfile.mkdtemp(prefix="bench-memory-tier-", dir=args.dir)
    started = time.monotonic()
    try:
        result = measure(work, mode, tuple(args.only or TARGETS))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for metric in result.values():
        metric["detail"]["elapsed_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if all(m["ok"] for m in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
