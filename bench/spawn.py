"""Run a function on N local processes joined in a gloo process group.

For benchmarks and tests of distributed code without torchrun: each rank is a new
process, ``spawn``ed (the benchmarks: :func:`run_on_ranks`) or, for the test suite,
forked by a ``forkserver`` that imported torch once (:data:`PRELOAD`), so a test does not
pay torch's import per rank (about 3 s of CPU each on a small machine). Either way a rank
gets the caller's environment as it is at the call. The group rendezvous through a temp
file (no port races).
Every run has a deadline: on expiry the processes started here are killed (by pid)
and an error is raised, so a hang fails instead of stalling.

It lives in ``bench`` (which is installed, so ``python -m bench`` works from a wheel);
the test suite imports it through :mod:`testing.spawn`. :func:`run_on_ranks` is the
benchmarks' form, with the longer collective timeout that large saves need.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint"]
"""Imported once by the forkserver the ranks are forked from (a module that fails to
import there is only imported by the ranks that use it)."""

_forkserver: Any = None


def _context(method: str) -> Any:
    global _forkserver
    if method != "forkserver":
        return mp.get_context(method)
    if _forkserver is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _forkserver = ctx
    return _forkserver


@dataclass
class RankOutcome:
    rank: int
    exitcode: int | None
    result: Any = None
    error: str | None = None


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    results: Any,
    args: tuple[Any, ...],
    env: dict[str, str],
    pg_timeout_s: float,
) -> None:
    # The forkserver's environment is the one of its start: the caller's now replaces it.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    import torch.distributed as dist

    code = 0
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        value = fn(rank, world_size, *args)
        # Plain pickle bytes: tensors sent as-is would travel as shared-memory handles
        # that vanish when this process exits.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        code = 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        # Leave without interpreter teardown, as the trainer does: a C++ abort at exit
        # ("terminate called without an active exception", SIGABRT) can turn a rank that
        # has finished and sent its result into a failed one. The result
        # must be out of the queue's feeder thread first.
        results.close()
        results.join_thread()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    pg_timeout_s: float = 60.0,
    start_method: str = "forkserver",
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; outcomes in rank order.

    ``env`` is added to each rank's environment; ``pg_timeout_s`` is the collective
    timeout of the rank's process group. Raises TimeoutError (after killing the
    ranks it started) if any is still running after ``timeout_s``.
    """
    ctx = _context(start_method)
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="pg-init-")
    os.close(fd)
    os.unlink(init_file)
    rank_env = {**os.environ, **(env or {})}
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, world_size, init_file, results, args, rank_env, pg_timeout_s),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes = {r: RankOutcome(rank=r, exitcode=None) for r in range(world_size)}
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            _drain(results, outcomes, wait_s=0.2)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout_s:.0f} s")
        _drain(results, outcomes, wait_s=0.5)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        if os.path.exists(init_file):
            os.unlink(init_file)
    for r, p in enumerate(procs):
        outcomes[r].exitcode = p.exitcode
    return [outcomes[r] for r in range(world_size)]


class RankFailedError(RuntimeError):
    """A rank raised, died or outlived the deadline."""


def run_ok(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    pg_timeout_s: float = 60.0,
    start_method: str = "forkserver",
) -> list[Any]:
    """Like :func:`run_ranks`, but every rank must succeed; returns the results in rank order.

    Raises :class:`RankFailedError` with every failed rank's traceback otherwise.
    """
    try:
        outcomes = run_ranks(
            fn,
            world_size,
            *args,
            timeout_s=timeout_s,
            env=env,
            pg_timeout_s=pg_timeout_s,
            start_method=start_method,
        )
    except TimeoutError as exc:
        raise RankFailedError(f"{getattr(fn, '__name__', fn)}: {exc}") from None
    failed = [o for o in outcomes if o.exitcode != 0 or o.error is not None]
    if failed:
        details = "\n".join(f"--- rank {o.rank} (exit {o.exitcode}):\n{o.error}" for o in failed)
        raise RankFailedError(f"{len(failed)} rank(s) failed:\n{details}")
    return [o.result for o in outcomes]


def _drain(results: Any, outcomes: dict[int, RankOutcome], wait_s: float) -> None:
    try:
        while True:
            rank, status, value = results.get(timeout=wait_s)
            if status == "ok":
                outcomes[rank].result = pickle.loads(value)
            else:
                outcomes[rank].error = value
            wait_s = 0.01
    except queue.Empty:
        return


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; results in rank order.

    Spawned: ranks started from a forkserver save slower in the save group (the cause is
    not known), so the benchmarks keep the start method their history used."""
    return run_ok(
        fn, world_size, *args, timeout_s=timeout_s, pg_timeout_s=300.0, start_method="spawn"
    )
