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

c10d runs with ``last_call_timeout=1`` (whole seconds are its floor; the default is 30)
and its default keep-alive (every 5 s, dead after 3 missed): with a keep-alive every
second, as the e2e tests use, its agents' writes of the shared state contend so much
that 32 agents on a 2-core machine do not finish a round within minutes. ``ft`` runs
with its defaults.

Store requests: each agent wraps the stores its handler talks to in a counter (every
call of a store method is one request; a ``multi_get`` is one); ``<phase>_requests`` is
the sum over agents during the phase, keep-alives included. A phase that does not
finish within its timeout ends the simulation: the row has the phases before it, and
``timed_out`` (the phase) and ``<phase>_at_least_s`` (the timeout).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import time
from datetime import timedelta
from typing import Any

QUICK_N = (8,)
FULL_N = (8, 32, 128, 256)
BACKENDS = ("c10d", "ft")
CONF = {
    "c10d": {"last_call_timeout": "1", "join_timeout": "600"},
    "ft": {"join_timeout": "600"},
}
PHASE_TIMEOUT_S = 60.0
AFTER_DEATH_TIMEOUT_S = 30.0
"""Bound of the re-round after an agent's death, at most ``phase_timeout_s``: on 2 cores
c10d's takes over ten seconds at 8 agents and does not end within a minute at 32; ours
takes a few seconds."""
PHASES = ("first_round_s", "reround_s", "reround_after_death_s")


def _agent(backend, port, n, index, events, results, store_up) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    store_up.wait()  # connect once the store listens (no client retries and back-off)

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
    counter = _count_requests(handler)
    results.put(("ready", index, 0.0, 0, 0))
    for phase, event in zip(PHASES, events):
        if phase == "reround_after_death_s" and index == 0:
            _exit(results)  # this agent dies: no shutdown, no more keep-alives
        event.wait()
        before = counter.n
        info = handler.next_rendezvous()
        results.put((phase, index, time.time(), info.world_size, counter.n - before))
    _exit(results)


class _Counted:
    """A store whose method calls are counted (one call, one request to the server)."""

    def __init__(self, store: Any, counter: Any) -> None:
        self._store, self._counter = store, counter

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._counter.n += 1
            return attr(*args, **kwargs)

        return call


def _count_requests(handler: Any) -> Any:
    """Wrap the stores ``handler`` uses for its rounds and keep-alives in one counter
    (``.n``): c10d's state backend, ft's store and its keep-alive connection."""
    counter = type("Counter", (), {"n": 0})()
    backend = getattr(getattr(handler, "_state_holder", None), "_backend", None)
    if backend is not None:  # c10d: every state read and write goes through this store
        backend._store = _Counted(backend._store, counter)
    if hasattr(handler, "_hb_store"):  # ft
        handler._store = _Counted(handler._store, counter)
        if handler._hb_store is not None:
            handler._hb_store = _Counted(handler._hb_store, counter)
    return counter


def _exit(results) -> None:
    results.close()
    results.join_thread()  # what was put reaches the parent before the process ends
    os._exit(0)


def simulate(
    backend: str, n: int, timeout_s: float = 600.0, phase_timeout_s: float = PHASE_TIMEOUT_S
) -> dict[str, Any]:
    """Seconds of each of :data:`PHASES` for ``n`` agents of ``backend`` (see the module
    docstring), the world size each round came to and the store requests it took.
    ``timeout_s`` bounds the whole simulation (a TimeoutError while the agents start),
    ``phase_timeout_s`` each phase, and :data:`AFTER_DEATH_TIMEOUT_S` at most the re-round
    after a death (the row then says ``timed_out``)."""
    from torch.distributed import TCPStore

    from bench.harness.ports import free_port

    ctx = mp.get_context("fork")
    port = free_port()
    # torch's socket code looks up the name of a connecting peer (getnameinfo); where no
    # DNS server answers (a sandbox), a lookup the hosts file cannot answer waits out
    # the resolver's timeout, 5 s, twice, so connecting many agents takes far longer
    # than their rounds. Nothing timed changes: the agents connect before
    # the first round. A RES_OPTIONS already set is kept.
    resolver = os.environ.get("RES_OPTIONS")
    if resolver is None:
        os.environ["RES_OPTIONS"] = "timeout:1 attempts:1"
    events = [ctx.Event() for _ in PHASES]
    store_up = ctx.Event()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_agent, args=(backend, port, n, i, events, results, store_up), daemon=True
        )
        for i in range(n)
    ]
    # Children are forked before this process starts the store's threads.
    for p in procs:
        p.start()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)
    store.set_timeout(timedelta(seconds=timeout_s))
    store_up.set()
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
            bound = phase_timeout_s
            if phase == "reround_after_death_s":
                bound = min(bound, AFTER_DEATH_TIMEOUT_S)
            phase_deadline = min(deadline, time.monotonic() + bound)
            try:
                rows = _collect(results, phase, expected, phase_deadline)
            except TimeoutError as exc:
                out["timed_out"] = phase
                out[phase.replace("_s", "_at_least_s")] = round(time.time() - start, 1)
                out["error"] = str(exc)
                break
            out[phase] = max(t for _, t, _, _ in rows) - start
            out[phase.replace("_s", "_world")] = sorted({w for _, _, w, _ in rows})
            out[phase.replace("_s", "_requests")] = sum(r for _, _, _, r in rows)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        del store
        if resolver is None:
            os.environ.pop("RES_OPTIONS", None)
    return out


def _collect(results, phase: str, count: int, deadline: float) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    while len(rows) < count:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise queue.Empty
            got = results.get(timeout=left)
        except queue.Empty:
            raise TimeoutError(f"{phase}: {len(rows)} of {count} agents done") from None
        if got[0] != phase:
            raise RuntimeError(f"expected {phase}, got {got}")
        rows.append(got[1:])
    return rows


def describe(row: dict[str, Any]) -> str:
    """One line for a row of :func:`simulate` (or a failed one: its ``error``)."""
    parts = [
        f"{p}={row[p]:.3f} ({row[p.replace('_s', '_requests')]} requests)"
        for p in PHASES
        if p in row
    ]
    if "timed_out" in row:
        at_least = row[row["timed_out"].replace("_s", "_at_least_s")]
        parts.append(f"{row['timed_out']} did not finish in {at_least:g} s ({row['error']})")
    elif "error" in row:
        parts.append(f"not measured ({row['error']})")
    return ", ".join(parts)


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
