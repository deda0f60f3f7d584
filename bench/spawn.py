"""Run a function on N spawned processes joined in a gloo process group.

The group rendezvous through a temp file (no port races). Every run has a
deadline: on expiry the processes started here are killed (by pid) and an error
is raised, so a hang ends the benchmark instead of stalling it.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any


class RankFailedError(RuntimeError):
    """A rank raised, died or outlived its deadline."""


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    results: Any,
    args: tuple[Any, ...],
) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=300),
        )
        value = fn(rank, world_size, *args)
        results.put((rank, None, pickle.dumps(value)))
    except BaseException:
        results.put((rank, traceback.format_exc(), None))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="bench-pg-")
    os.close(fd)
    os.unlink(init_file)
    procs = [
        ctx.Process(
            target=_rank_main, args=(fn, r, world_size, init_file, results, args), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) + len(errors) < world_size:
            if time.monotonic() > deadline:
                raise RankFailedError(f"{fn.__name__}: ranks still running after {timeout_s:.0f} s")
            try:
                rank, error, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in values]
                if dead and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        raise RankFailedError(
                            f"{fn.__name__}: rank(s) {dead} exited with "
                            f"{[procs[r].exitcode for r in dead]} and no result"
                        ) from None
                continue
            if error is not None:
                errors[rank] = error
                break
            values[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(10 if not errors else 0.1)
            if p.is_alive():
                p.kill()
                p.join(5)
        if os.path.exists(init_file):
            os.unlink(init_file)
    if errors:
        rank, trace = next(iter(errors.items()))
        raise RankFailedError(f"{fn.__name__} failed on rank {rank}:\n{trace}")
    return [values[r] for r in range(world_size)]
