"""Async saves: how long training is blocked, and how much a background persist slows it.

Run on every rank of a spawned gloo group (see :mod:`bench.spawn`):

- stall rounds: three saves of the same FSDP2 state (the MLP + AdamW), order
  rotating per round; the sync and the overlapped one are each followed by one
  training step of that MLP (forward/backward on ``MLP_BATCH`` rows, then
  ``optimizer.step()``):

  * sync ``ckpt.save``: its time is the denominator (the step after it is the
    "no save in flight" step time);
  * ``async_save=True`` (staging in the call): blocked = the call (staging into
    host buffers + the caller-thread part of the protocol);
  * ``async_save=True, overlap_staging=optimizer`` (the trainer's setting): the call
    returns before copying; the copy overlaps the step's forward/backward, and the
    step's ``optimizer.step()`` waits for it if it is not done. Blocked = the call
    + that wait (``PendingSave.gate_wait_s``). The step's own time, with and
    without a save in flight, is reported too (the copy shares the cores).

  Times are the slowest rank's. Round 0 is the first save (staging buffers are
  allocated); later rounds reuse the buffers (steady state).
- interference rounds: training steps of the trainer's tiny GPT (2 ranks, FSDP2,
  ``trainer.loop.train_step``) with no save, and while an async save of the large
  state persists in the background; order rotating per round.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch

from bench.fsdp_state import build_trained, local_tensor_bytes, sharded_state

MLP_BATCH = 16
"""Rows per training step of the saved MLP in the stall rounds."""


def _max_over_ranks(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _all_done(flag: bool) -> bool:
    import torch
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def async_rounds(
    rank: int, world: int, work: str, width: int, rounds: int, base_steps: int
) -> dict[str, Any]:
    import torch.distributed as dist

    import ckpt
    from bench.gpt import build_tiny_gpt
    from trainer.loop import train_step

    model, optim = build_trained(width)
    state = sharded_state(model, optim)
    state_bytes = sum(_gather(local_tensor_bytes(state)))
    sync_s: list[float] = []
    async_block_s: list[float] = []
    async_reported_s: list[float] = []
    async_total_s: list[float] = []
    overlap_block_s: list[float] = []
    overlap_call_s: list[float] = []
    overlap_gate_s: list[float] = []
    overlap_step_s: list[float] = []
    plain_step_s: list[float] = []
    root = os.path.join(work, "async")
    step = 0
    batch = torch.randn(MLP_BATCH, width, generator=torch.Generator().manual_seed(rank))

    def mlp_step() -> float:
        t0 = time.perf_counter()
        model(batch).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        return time.perf_counter() - t0

    def sync_save() -> None:
        nonlocal step
        step += 1
        dist.barrier()
        t0 = time.perf_counter()
        ckpt.save(state, root, step)
        dist.barrier()
        sync_s.append(time.perf_counter() - t0)

        plain_step_s.append(_max_over_ranks(mlp_step()))

    def async_save() -> None:
        nonlocal step
        step += 1
        dist.barrier()
        t0 = time.perf_counter()
        pending = ckpt.save(state, root, step, async_save=True)
        blocked = time.perf_counter() - t0
        pending.wait()
        dist.barrier()
        async_total_s.append(time.perf_counter() - t0)
        async_block_s.append(_max_over_ranks(blocked))
        async_reported_s.append(_max_over_ranks(pending.blocking_s))

    def async_overlap() -> None:
        nonlocal step
        step += 1
        dist.barrier()
        t0 = time.perf_counter()
        pending = ckpt.save(state, root, step, async_save=True, overlap_staging=optim)
        call = time.perf_counter() - t0
        step_s = mlp_step()  # forward/backward overlap the copy; optimizer.step() is gated
        blocked = call + pending.gate_wait_s
        pending.wait()
        dist.barrier()
        overlap_block_s.append(_max_over_ranks(blocked))
        overlap_call_s.append(_max_over_ranks(call))
        overlap_gate_s.append(_max_over_ranks(pending.gate_wait_s))
        overlap_step_s.append(_max_over_ranks(step_s))

    ops = [sync_save, async_save, async_overlap]
    for i in range(rounds + 1):
        for op in ops[i % 3 :] + ops[: i % 3]:
            op()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()

    # Interference: the tiny GPT trains on the default group; the save uses its own.
    g = build_tiny_gpt(rank, world)

    def one_step() -> float:
        t0 = time.perf_counter()
        train_step(g.model, g.optimizer, g.samples, g.sampler, g.layout, g.cfg, g.ctx)
        g.sampler.advance()
        return time.perf_counter() - t0

    for _ in range(3):  # warm-up: allocations, gloo connections
        one_step()
    quiet: list[list[float]] = []
    busy: list[list[float]] = []
    persist_s: list[float] = []

    def without_save() -> None:
        times = []
        for _ in range(base_steps):
            times.append(one_step())
            _all_done(True)  # the same tiny collective as the busy side
        quiet.append(times)

    def with_save() -> None:
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        pending = ckpt.save(state, root, step, async_save=True)
        times = []
        while True:
            times.append(one_step())
            if _all_done(pending.done()):
                break
        pending.wait()
        persist_s.append(time.perf_counter() - t0)
        busy.append(times)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()

    ops = [without_save, with_save]
    for i in range(rounds):
        for op in ops[i % 2 :] + ops[: i % 2]:
            op()
    ckpt.close()
    return {
        "state_bytes": state_bytes,
        "sync_s": sync_s,
        "async_block_s": async_block_s,
        "async_reported_s": async_reported_s,
        "async_total_s": async_total_s,
        "overlap_block_s": overlap_block_s,
        "overlap_call_s": overlap_call_s,
        "overlap_gate_s": overlap_gate_s,
        "overlap_step_s": overlap_step_s,
        "plain_step_s": plain_step_s,
        "mlp_batch": MLP_BATCH,
        "quiet_steps_s": _gather(quiet),
        "busy_steps_s": _gather(busy),
        "persist_s": persist_s,
    }


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def staging_rounds(rank: int, world: int, work: str, width: int, saves: int) -> dict[str, Any]:
    """``saves`` async saves in a row through one ``CheckpointManager``, as a training
    loop makes them, each waited for; this process's RSS after each one committed.

    The first save allocates the staging buffers; the others must reuse them, so RSS
    after the last save stays near RSS after the first (``async_staging_growth``).
    """
    import ckpt

    model, optim = build_trained(width)
    root = os.path.join(work, "staging")
    rss_mib: list[float] = []
    state = {"model": model, "optim": optim}
    with ckpt.CheckpointManager(root, state=state, async_save=True, keep_last=2) as manager:
        for step in range(1, saves + 1):
            manager.save(step, blocking=False)
            manager.wait()
            rss_mib.append(_rss_mib())
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "rss_mib": _gather(rss_mib),
        "state_bytes": sum(_gather(local_tensor_bytes(sharded_state(model, optim)))),
    }


def _gather(value: Any) -> list[Any]:
    from bench.rounds import dist_all_gather

    return dist_all_gather(value)
