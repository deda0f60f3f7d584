"""Rendezvous at scale by simulation: N handler-only agents against one TCPStore.

``python -m bench.rendezvous [--n 8 32 ...] [--backends c10d ft] [--json OUT]``

Each of N forked processes builds the backend's handler exactly as torchrun would
(:func:`torch.distributed.elastic.rendezvous.registry.get_rendezvous_handler`, with
``--nnodes=N-1:N`` and ``is_host=0``; the store is hosted by the parent) and runs no
training. Three rounds, each started at once in every process by an event, are timed
from that start to the last process's return from ``next_rendezvous``:

- ``first_round_s``: all N join a new rendezvous;
- ``reround_s``: all N rejoin at once (a worker failed, every agent restarts its group);
- ``reround_after_death_s``: one process exits without a word (its agent died) just
  before the other N-1 rejoin.

c10d runs with the suite's settings (``last_call_timeout=1``, ``keep_alive_interval=1``,
``keep_alive_max_attempt=5``: whole seconds are its floor), ``ft`` with its defaults.
The store's request count is not measured yet (TCPStore exposes no counter).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta
from typing import Any

QUICK_N = (8,)
FULL_N = (8, 32, 128, 256)
BACKENDS = ("c10d", "ft")
CONF = {
    "c10d": {
        "last_call_timeout": "1",
        "keep_alive_interval": "1",
        "keep_alive_max_attempt": "5",
        "join_timeout": "120",
    },
    "ft": {"join_timeout": "120"},
}
PHASES = ("first_round_s", "reround_s", "reround_after_death_s")


def _agent(backend, port, n, index, events, results) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    params = RendezvousParameters(
        backend=backend,
        endpoint=f"127.0.0.1:{port}",
        run_id="sim",
        min_nodes=max(1, n - 1),
        max_nodes=n,
        local_addr="127.0.0.1",
        is_host="0",
        **CONF[backend],
    )
    handler = get_rendezvous_handler(params)
    results.put(("ready", index, 0.0, 0))
    for phase, event in zip(PHASES, events):
        if phase == "reround_after_death_s" and index == 0:
            _exit(results)  # this agent dies: no shutdown, no more keep-alives
        event.wait()
        info = handler.next_rendezvous()
        results.put((phase, index, time.time(), info.world_size))
    _exit(results)


def _exit(results) -> None:
    results.close()
    results.join_thread()  # what was put reaches the parent before the process ends
    os._exit(0)


def simulate(backend: str, n: int, timeout_s: float = 300.0) -> dict[str, Any]:
    """Seconds of each of :data:`PHASES` for ``n`` agents of ``backend`` (see the module
    docstring), and the world size each round came to."""
    from torch.distributed import TCPStore

    from testing.ports import free_port

    ctx = mp.get_context("fork")
    port = free_port()
    events = [ctx.Event() for _ in PHASES]
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_agent, args=(backend, port, n, i, events, results), daemon=True)
        for i in range(n)
    ]
    # Children are forked before this process starts the store's threads.
    for p in procs:
        p.start()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)
    store.set_timeout(timedelta(seconds=timeout_s))
    deadline = time.monotonic() + timeout_s
    out: dict[str, Any] = {"backend": backend, "n": n}
    try:
        _collect(results, "ready", n, deadline)
        for phase, event in zip(PHASES, events):
            if phase == "reround_after_death_s":
                procs[0].join(timeout=30)
            expected = n - 1 if phase == "reround_after_death_s" else n
            start = time.time()
            event.set()
            rows = _collect(results, phase, expected, deadline)
            out[phase] = max(t for _, t, _ in rows) - start
            out[phase.replace("_s", "_world")] = sorted({w for _, _, w in rows})
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        del store
    return out


def _collect(results, phase: str, count: int, deadline: float) -> list[tuple[int, float, int]]:
    rows = []
    while len(rows) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{phase}: {len(rows)} of {count} agents done")
        got = results.get(timeout=left)
        if got[0] != phase:
            raise RuntimeError(f"expected {phase}, got {got}")
        rows.append(got[1:])
    return rows


def describe(row: dict[str, Any]) -> str:
    """One line for a row of :func:`simulate` (or a failed one: its ``error``)."""
    if "error" in row:
        return f"not measured ({row['error']})"
    return ", ".join(f"{p}={row[p]:.3f}" for p in PHASES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=list(QUICK_N))
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    for n in args.n:
        for backend in args.backends:
            t0 = time.monotonic()
            row = simulate(backend, n)
            rows.append(row)
            print(
                f"{backend:5s} N={n:4d}: {describe(row)} ({time.monotonic() - t0:.1f} s)",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
