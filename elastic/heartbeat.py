"""Peer failure detection: heartbeats through the process group's TCP store.

A node that freezes (SIGSTOP, a hypervisor pause, a kernel stuck in I/O) or whose
link is cut (packets dropped, no reset) leaves its peers blocked in a collective: no
connection is reset, so gloo/NCCL wait for the collective timeout. Each rank runs a
:class:`PeerHeartbeat`: it bumps a counter of its own in a TCP store every
``interval_s`` and reads its peers' counters, from daemon threads independent of the
training thread. A peer whose counter has not moved for ``timeout_s`` of this rank's
observation makes this rank log an error naming the silent rank and its host, report
a :class:`SilentVerdict` (``on_silent``) and leave with ``PEER_SILENT_EXIT_CODE``
(``os._exit``), so torchrun's agent sees a failed worker and re-rendezvouses without
the silent node.

The channel is not the collectives it guards: a separate client connection (its own
socket) to the store the default process group was built on (``MASTER_ADDR:MASTER_PORT``
under torchrun). With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` that store lives in the
rank-0 worker (a C++ server thread that does not need the GIL); otherwise in the
rank-0 agent or a standalone rendezvous store. A store call on a frozen server blocks
without any timeout (as of torch 2.13: the client's ``timeout`` bounds waits
for keys, not a server that stopped answering), so calls are never bounded by their
own timeout: one thread does the store round trips and may block, another judges from
the time of the last completed round trip. A store that has not answered for
``timeout_s`` counts as the rank hosting it (rank 0) being silent.

Long legitimate phases (first step, checkpoint load and save, a slow step) do not
look like silence, because the counter is bumped by a thread of its own: a busy
training thread, blocked in a collective or in C++ code that releases the GIL (every
torch op, socket and file I/O), does not stop it. A frozen process stops all of its
threads. What also stops it: a call that holds the GIL for longer than the bound (a
pure C loop such as ``sum(range(10**9))``); such a rank looks frozen and is removed.
When this rank's own threads were not scheduled for a while (the monitor woke much
later than asked), it judges nobody from that gap and starts observing afresh.

Under ``--rdzv_backend=ft`` a third thread reads the keep-alives that the peers' torchrun
agents write to the rendezvous store (:mod:`elastic.nodes`): a peer whose node stopped
too is silent after the node bound (1 s) instead of the peer bound, and a peer whose
node lives while its own heartbeat stopped (a process holding the GIL) is said to be
stalled and waited for (:func:`peer_status`).

Standard library only at import time (the store client imports torch lazily).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from elastic.nodes import (
    DEFAULT_NODE_TIMEOUT_S,
    DEFAULT_STALL_LIMIT_S,
    NodeChannel,
    check_node_bounds,
    keepalive_counter,
    node_id_text,
)
from elastic.process import call_bounded, leave_from_monitor

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 0.25
"""Seconds between two heartbeats (and two reads of the peers' counters and of their
nodes' keep-alives)."""
DEFAULT_PEER_TIMEOUT_S = 5.0
"""A peer whose counter did not move for this long is silent."""
PEER_SILENT_EXIT_CODE = 125
"""Exit code of a rank that left because a peer (or the store) went silent."""
STARTUP_GRACE_S = 10.0
"""Extra time a peer gets for its first heartbeat (ranks enter the guard at slightly
different times)."""
JUDGE_EVERY_S = 0.05
"""How often the monitor judges what the reads saw (at most every heartbeat interval):
a bound crossed between two reads is acted on within this, not up to an interval later.
Judging reads no store; it compares times under a lock."""
DEPARTED_LIMIT_S = 0.5
"""The most marking the silent nodes departed may take before the rank leaves anyway."""
MAX_KEEPALIVE_BYTES = 64
"""Longer keep-alive values are not kept for the departed mark (they are not ours)."""
SELF_STALL_S = 2.0
"""The monitor woke this much later than asked: this process was not running (GIL held
by a C call, CPU starvation, SIGSTOP); the gap is not held against anyone."""
ON_SILENT_LIMIT_S = 3.0
"""The most the ``on_silent`` callback (an event write) may take before the exit."""
LEFT = 1 << 40
"""Added to a counter by a rank that stops cleanly: values >= LEFT mean "left"."""


def parse_counter(raw: bytes | str) -> int | None:
    """A heartbeat counter read from the store, or None when the value is not one.

    Store values are input from anyone who reaches the store: a malformed one is
    ignored (and said), never a crash of the rank that reads it.
    """
    try:
        text = raw.decode("ascii") if isinstance(raw, bytes) else raw
        value = int(text)
    except (UnicodeDecodeError, ValueError):
        return None
    return value if 0 <= value < 2 * LEFT + (1 << 32) else None


WATCH_ALL_UP_TO = 64
"""Up to this world size every rank watches every peer; above it, ``NEIGHBOURS``."""
NEIGHBOURS = 8
"""Peers watched by each rank in larger worlds (the next ranks on a ring)."""
KEY_PREFIX = "elastic_heartbeat"


class StoreLike(Protocol):
    """What the heartbeat needs of a ``torch.distributed.Store``."""

    def add(self, key: str, value: int) -> int: ...

    def multi_get(self, keys: list[str]) -> list[bytes]: ...

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


# -- pure decisions ------------------------------------------------------------------------


def silent_peers(last_seen: Mapping[int, float], now: float, bound: float) -> list[int]:
    """Ranks whose last sign of life is more than ``bound`` seconds before ``now`` (sorted).

    Pure. ``last_seen`` maps a rank to the (monotonic) time its heartbeat counter was
    last seen moving; a time in the future (a startup grace) is never silent. Exactly
    ``bound`` seconds is not yet silent.
    """
    if not math.isfinite(bound) or bound <= 0:
        raise ValueError(f"bound must be a finite number > 0, got {bound}")
    return sorted(rank for rank, seen in last_seen.items() if now - seen > bound)


OK, SILENT, NODE_SILENT, STALLED, STALL_LIMIT = "ok", "silent", "node_silent", "stalled", "stall_limit"
"""What :func:`peer_status` says of a peer: alive; silent past the peer bound (no node
keep-alive to read); silent with its node's keep-alive (frozen or cut off); stalled (its
node lives); stalled past the stall limit. The three silent ones end this rank."""
SILENT_STATUSES = frozenset({SILENT, NODE_SILENT, STALL_LIMIT})


def peer_status(
    age: float,
    node_age: float | None,
    *,
    timeout_s: float,
    node_timeout_s: float,
    stall_limit_s: float,
) -> str:
    """Pure. ``age``: seconds since the peer's heartbeat counter last moved; ``node_age``:
    since its node's keep-alive last moved, None when there is none to read (then the
    peer bound ``timeout_s`` alone decides, as without :mod:`elastic.nodes`)."""
    if node_age is None:
        return SILENT if age > timeout_s else OK
    if node_age > node_timeout_s and age > node_timeout_s:
        return NODE_SILENT
    if age > stall_limit_s:
        return STALL_LIMIT
    return STALLED if age > timeout_s else OK


def store_status(
    store_age: float, host_node_age: float | None, *, timeout_s: float, node_timeout_s: float
) -> str:
    """Pure. The store (hosted by a rank's process) has not answered for ``store_age``:
    silent past ``timeout_s``, or past ``node_timeout_s`` when the host's node keep-alive
    stopped too; else alive."""
    if store_age > timeout_s:
        return SILENT
    if host_node_age is not None and host_node_age > node_timeout_s and store_age > node_timeout_s:
        return NODE_SILENT
    return OK


def watched_peers(
    rank: int,
    world_size: int,
    *,
    watch_all_up_to: int = WATCH_ALL_UP_TO,
    neighbours: int = NEIGHBOURS,
) -> list[int]:
    """The peers ``rank`` watches: all of them in small worlds, else the next ``neighbours``
    ranks on a ring (each rank is then watched by ``neighbours`` others). Pure."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    if world_size <= watch_all_up_to:
        return [r for r in range(world_size) if r != rank]
    count = min(neighbours, world_size - 1)
    return sorted((rank + k) % world_size for k in range(1, count + 1))


def first_beat_bound_s(peer_timeout_s: float) -> float | None:
    """How long a peer that never sent a heartbeat has before it is judged silent:
    ``peer_timeout_s`` + :data:`STARTUP_GRACE_S` (None when the detector is off, 0). The
    bound of every wait for the other ranks during a start-up. Pure."""
    return peer_timeout_s + STARTUP_GRACE_S if peer_timeout_s > 0 else None


def namespace(run_id: str, attempt: int, world_size: int) -> str:
    """Key prefix of one process group's heartbeats: run id, job-wide restart count,
    world size (a new group after a restart or a membership change gets new keys)."""
    return f"{KEY_PREFIX}/{run_id}/{attempt}/{world_size}"


# -- where the store is ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoreAddress:
    """The TCP store the heartbeats go through."""

    host: str
    port: int
    host_rank: int | None
    """Global rank whose process hosts the store (0: the default group's store created by
    rank 0), None when an agent or a standalone process hosts it."""

    def describe(self) -> str:
        where = (
            f"hosted by rank {self.host_rank}"
            if self.host_rank is not None
            else "hosted by a torchrun agent or a standalone store"
        )
        return f"the TCP store at {self.host}:{self.port} ({where})"


def store_address(env: Mapping[str, str] | None = None) -> StoreAddress | None:
    """The TCP store of the default process group, or None (no group, or not a TCP store).

    Unwraps ``PrefixStore``s down to the ``TCPStore`` and takes its host and port; falls
    back to ``MASTER_ADDR``/``MASTER_PORT`` only when the store cannot be inspected. Under torchrun with the agent's store shared
    (``TORCHELASTIC_USE_AGENT_STORE=True``) an agent hosts it, else rank 0.
    """
    source = os.environ if env is None else env
    host: str | None = None
    port: int | None = None
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    try:
        store: Any = dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        if not isinstance(store, dist.TCPStore):
            return None  # a FileStore or HashStore: no server to heartbeat through
        host, port = store.host, int(store.port)
    except Exception as exc:  # a private API: fall back to the environment
        logger.debug("heartbeat: could not inspect the default store: %s", exc)
    if host is None:
        host = source.get("MASTER_ADDR") or None
        raw_port = source.get("MASTER_PORT", "")
        port = int(raw_port) if raw_port.strip().isdigit() else None
    if host is None or port is None:
        return None
    shared = source.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("true", "1")
    return StoreAddress(host=host, port=port, host_rank=None if shared else 0)


def local_address(toward: str, port: int) -> str | None:
    """This machine's address on the route to ``toward`` (no packet is sent), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((toward, port))
            return str(sock.getsockname()[0])
    except OSError:
        return None


def tcp_store_client(address: StoreAddress, timeout_s: float) -> StoreLike:
    """A new client connection to the store (its own socket, not the process group's)."""
    import datetime

    from torch.distributed import TCPStore

    return TCPStore(
        address.host,
        address.port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def _check_bounds(interval_s: float, timeout_s: float) -> None:
    if not math.isfinite(interval_s) or interval_s <= 0:
        raise ValueError(f"heartbeat interval must be a finite number > 0, got {interval_s}")
    if not math.isfinite(timeout_s) or timeout_s < 2 * interval_s:
        raise ValueError(
            f"peer timeout must be at least twice the heartbeat interval ({interval_s}s), "
            f"got {timeout_s}"
        )


def group_heartbeat(
    *,
    run_id: str,
    attempt: int,
    interval_s: float,
    timeout_s: float,
    on_silent: Callable[[SilentVerdict], None] | None = None,
    keep_running: Callable[[], bool] | None = None,
    judge_store: bool = True,
    env: Mapping[str, str] | None = None,
    node_timeout_s: float = DEFAULT_NODE_TIMEOUT_S,
    stall_limit_s: float = DEFAULT_STALL_LIMIT_S,
    on_stall: Callable[[StallNotice], None] | None = None,
) -> PeerHeartbeat | None:
    """A started detector over the default process group's TCP store (keys of
    :func:`namespace`), or None: ``timeout_s`` 0, no group of 2+ ranks, or not a TCP store.
    Under ``--rdzv_backend=ft`` it also reads the peers' node keep-alives
    (:mod:`elastic.nodes`; ``node_timeout_s`` 0: never).

    Every rank of the group calls it at the same point (``elastic.init_distributed`` right
    after the group exists; ``RunGuard`` on entry when it has no detector to take over).
    """
    if timeout_s <= 0:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    address = store_address(env)
    if address is None:
        logger.info(
            "rank %d: peer heartbeat off: the process group's store is not a TCP store", rank
        )
        return None
    heartbeat = PeerHeartbeat(
        rank=rank,
        world_size=world,
        address=address,
        key_prefix=namespace(run_id, attempt, world),
        interval_s=interval_s,
        timeout_s=timeout_s,
        on_silent=on_silent,
        keep_running=keep_running,
        judge_store=judge_store,
        nodes=NodeChannel.from_env(env) if node_timeout_s > 0 else None,
        node_timeout_s=node_timeout_s or DEFAULT_NODE_TIMEOUT_S,
        stall_limit_s=stall_limit_s,
        on_stall=on_stall,
    )
    return heartbeat.start()


# -- the verdict ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SilentVerdict:
    """Why this rank is leaving: silent peers, or a store that stopped answering."""

    rank: int
    """The rank that judged."""
    silent_ranks: list[int]
    """The silent peers (the store host's rank when the store is silent and a rank hosts it)."""
    hosts: dict[int, str]
    """What each silent rank said about itself at start: host, address, pid."""
    silent_s: float
    """How long the (first) silent peer, or the store, has been silent."""
    bound_s: float
    store_silent: bool
    """True when the store itself stopped answering."""
    store: str
    """Where the store is (:meth:`StoreAddress.describe`)."""
    node_witness: bool = False
    """True when the silent ranks' node keep-alive had stopped too (:mod:`elastic.nodes`),
    which is what let the verdict come at the node bound."""

    def message(self) -> str:
        who = ", ".join(
            f"rank {r} ({self.hosts.get(r, 'host unknown')})" for r in self.silent_ranks
        )
        if self.store_silent:
            what = f"{self.store} has not answered for {self.silent_s:.1f}s"
            if who:
                what += f": {who} is silent (frozen, or its link is cut)"
        elif self.node_witness:
            what = (
                f"{who} sent no heartbeat for {self.silent_s:.1f}s through {self.store} and "
                "its node's keep-alive stopped too (frozen, or its link is cut)"
            )
        else:
            what = (
                f"{who} sent no heartbeat for {self.silent_s:.1f}s through {self.store} "
                "(frozen, or its link is cut)"
            )
        return (
            f"rank {self.rank}: peer failure detected: {what}; bound {self.bound_s:.1f}s. "
            f"Leaving with exit code {PEER_SILENT_EXIT_CODE} so torchrun re-rendezvouses "
            "without the silent node"
        )

    def fields(self) -> dict[str, Any]:
        """Event fields (``peer_silent``)."""
        return {
            "silent_ranks": list(self.silent_ranks),
            "hosts": {str(r): h for r, h in self.hosts.items()},
            "silent_s": round(self.silent_s, 3),
            "bound_s": self.bound_s,
            "store_silent": self.store_silent,
            "store": self.store,
            "node_witness": self.node_witness,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class StallNotice:
    """A peer sent no heartbeat past the peer bound while its node lives: it is waited for."""

    rank: int
    """The rank that noticed."""
    stalled_rank: int
    stalled_s: float
    host: str
    """What the stalled rank said about itself at start: host, address, pid."""
    node: str
    limit_s: float
    """How long it is waited for in all (the stall limit) before it counts as silent."""

    def message(self) -> str:
        return (
            f"rank {self.rank}: rank {self.stalled_rank} ({self.host}) sent no heartbeat for "
            f"{self.stalled_s:.1f}s, but its node {self.node} is alive: its process is "
            "stalled (a long garbage collection, a call that holds the GIL, swapping), not "
            f"gone; waiting for it up to {self.limit_s:.0f}s"
        )

    def fields(self) -> dict[str, Any]:
        """Event fields (``peer_stalled``)."""
        return {
            "stalled_rank": self.stalled_rank,
            "stalled_s": round(self.stalled_s, 3),
            "host": self.host,
            "node": self.node,
            "limit_s": self.limit_s,
        }


# -- the detector ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Observed:
    """What the round-trip thread learned; read by the monitor under the lock."""

    last_ok: float
    """Monotonic time of the last completed store round trip."""
    last_seen: dict[int, float]
    values: dict[int, int] = field(default_factory=dict)
    left: set[int] = field(default_factory=set)
    hosts: dict[int, str] = field(default_factory=dict)
    beats: int = 0
    errors: int = 0
    max_round_trip_s: float = 0.0
    max_beat_gap_s: float = 0.0
    node_of: dict[int, str] = field(default_factory=dict)
    """Each peer's node id, as it published it (:mod:`elastic.nodes`)."""
    node_values: dict[str, int] = field(default_factory=dict)
    node_seen: dict[str, float] = field(default_factory=dict)
    """Monotonic time each node's keep-alive was last seen moving (or first read)."""
    node_raw: dict[str, bytes] = field(default_factory=dict)
    """Each node's keep-alive value as last read (well formed), for :meth:`_mark_departed`."""
    node_ok: float | None = None
    """Monotonic time of the last completed read of the node keep-alives."""
    stalled: dict[int, float] = field(default_factory=dict)
    """Peers said stalled, with the time their heartbeat had last moved then."""


class PeerHeartbeat:
    """Heartbeat to and watch of the peers of one process group (see the module docs).

    ``start()`` once the group exists (every rank), ``stop()`` when leaving cleanly
    (marks this rank as left, so peers do not mistake the exit for silence). On a
    verdict: log the error, ``on_silent(verdict)`` (bounded by ``ON_SILENT_LIMIT_S``),
    flush, ``os._exit(exit_code)``; with ``exit_process=False`` (tests) only the callback
    runs and the detector stops.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        address: StoreAddress,
        key_prefix: str,
        interval_s: float = DEFAULT_HEARTBEAT_S,
        timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
        on_silent: Callable[[SilentVerdict], None] | None = None,
        exit_code: int = PEER_SILENT_EXIT_CODE,
        exit_process: bool = True,
        peers: Sequence[int] | None = None,
        connect: Callable[[], StoreLike] | None = None,
        startup_grace_s: float = STARTUP_GRACE_S,
        self_info: str | None = None,
        keep_running: Callable[[], bool] | None = None,
        judge_store: bool = True,
        nodes: NodeChannel | None = None,
        node_timeout_s: float = DEFAULT_NODE_TIMEOUT_S,
        stall_limit_s: float = DEFAULT_STALL_LIMIT_S,
        connect_nodes: Callable[[], StoreLike] | None = None,
        on_stall: Callable[[StallNotice], None] | None = None,
    ) -> None:
        _check_bounds(interval_s, timeout_s)
        if nodes is not None:
            check_node_bounds(node_timeout_s, stall_limit_s, interval_s)
        self.rank = rank
        self.world_size = world_size
        self.address = address
        self.key_prefix = key_prefix
        self.interval_s = float(interval_s)
        self.timeout_s = float(timeout_s)
        self._malformed: set[str] = set()
        """Store keys found holding something that is not a counter (said once each)."""
        self.on_silent = on_silent
        self.exit_code = exit_code
        self.exit_process = exit_process
        self.peers = list(watched_peers(rank, world_size) if peers is None else peers)
        self._connect = connect or (lambda: tcp_store_client(address, self.store_timeout_s))
        self.startup_grace_s = startup_grace_s
        self.keep_running = keep_running
        """Checked before each round trip: False stops the detector as :meth:`stop` does
        (e.g. the process group it watches was destroyed)."""
        self.judge_store = judge_store
        """False: a store that stopped answering is no verdict, only peers that stopped
        while it answered are (the start-up detector: see ``elastic.distributed``)."""
        self.nodes = nodes
        """Where the peers' node keep-alives are read (None: not under ``ft``)."""
        self.node_timeout_s = float(node_timeout_s)
        self.stall_limit_s = float(stall_limit_s)
        self.on_stall = on_stall
        self._connect_nodes = connect_nodes or (
            lambda: tcp_store_client(
                StoreAddress(nodes.host, nodes.port, None), min(1.0, self.node_timeout_s / 2)
            )
        )
        self.self_info = self_info or self._describe_self()
        self.verdict: SilentVerdict | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._observed: _Observed | None = None
        self._threads: list[threading.Thread] = []

    # -- keys ---------------------------------------------------------------------------

    def key(self, rank: int) -> str:
        return f"{self.key_prefix}/beat/{rank}"

    def host_key(self, rank: int) -> str:
        return f"{self.key_prefix}/host/{rank}"

    def node_key(self, rank: int) -> str:
        return f"{self.key_prefix}/node/{rank}"

    def _describe_self(self) -> str:
        addr = local_address(self.address.host, self.address.port)
        where = f", address {addr}" if addr else ""
        return f"host {socket.gethostname()}{where}, pid {os.getpid()}"

    # -- lifetime -----------------------------------------------------------------------

    def start(self) -> PeerHeartbeat:
        """Start the round-trip and monitor threads (no-op without peers)."""
        if self._threads or not self.peers:
            return self
        now = time.monotonic()
        first = now + self.startup_grace_s
        self._observed = _Observed(last_ok=now, last_seen=dict.fromkeys(self.peers, first))
        targets = [(self._round_trips, "io"), (self._monitor, "monitor")]
        if self.nodes is not None:
            targets.append((self._node_reads, "nodes"))
        for target, name in targets:
            thread = threading.Thread(
                target=target, name=f"elastic-heartbeat-{name}-rank{self.rank}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        logger.info(
            "rank %d: peer heartbeat every %gs through %s, watching %d peer(s), bound %.1fs%s",
            self.rank, self.interval_s, self.address.describe(), len(self.peers), self.timeout_s,
            "" if self.nodes is None else (
                f"; with their nodes' keep-alives from {self.nodes.describe()}: bound "
                f"{self.node_timeout_s:.1f}s when a node stops too, a stalled rank waited "
                f"for up to {self.stall_limit_s:.0f}s"
            ),
        )  # fmt: skip
        return self

    @property
    def store_timeout_s(self) -> float:
        """Bound on one store call or connection attempt of the round-trip thread."""
        return min(2.0, self.timeout_s / 3)

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop both threads; the round-trip thread marks this rank as left on its way out
        (best effort: a blocked store call is abandoned after ``timeout_s``).

        The default wait covers, up to 2 s, one reconnection to a store that is gone
        (TCPStore's client tries twice with a pause between: about 3 x its timeout): a
        thread left inside that C++ call when the interpreter exits aborts the process
        ("terminate called without an active exception", exit -6) after a clean finish."""
        self._stop.set()
        if timeout_s is None:
            reconnect = min(2.0, 4 * self.store_timeout_s + self.interval_s)
            timeout_s = max(1.0, 2 * self.interval_s, reconnect)
        wait = timeout_s
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(wait)

    def configure(
        self,
        *,
        interval_s: float,
        timeout_s: float,
        on_silent: Callable[[SilentVerdict], None] | None,
        keep_running: Callable[[], bool] | None = None,
        judge_store: bool = True,
        node_timeout_s: float | None = None,
        stall_limit_s: float | None = None,
        on_stall: Callable[[StallNotice], None] | None = None,
    ) -> None:
        """New settings for a running detector (a new owner takes it over: ``RunGuard``
        adopting the start-up detector of ``init_distributed``); the threads read them at
        their next round."""
        _check_bounds(interval_s, timeout_s)
        node_timeout = self.node_timeout_s if node_timeout_s is None else node_timeout_s
        stall_limit = self.stall_limit_s if stall_limit_s is None else stall_limit_s
        if self.nodes is not None and node_timeout > 0:
            check_node_bounds(node_timeout, stall_limit, interval_s)
        with self._lock:
            self.interval_s = float(interval_s)
            self.timeout_s = float(timeout_s)
            self.on_silent = on_silent
            self.keep_running = keep_running
            self.judge_store = judge_store
            self.on_stall = on_stall
            if node_timeout_s == 0:
                self.nodes = None  # the new owner reads no keep-alives
            self.node_timeout_s = float(node_timeout or DEFAULT_NODE_TIMEOUT_S)
            self.stall_limit_s = float(stall_limit)

    def __enter__(self) -> PeerHeartbeat:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def stats(self) -> dict[str, Any]:
        """Counters for logs and benchmarks: beats, store errors, the longest store round
        trip and the longest gap between two of this rank's heartbeats."""
        obs = self._observed
        if obs is None:
            return {}
        with self._lock:
            return {
                "beats": obs.beats,
                "errors": obs.errors,
                "max_round_trip_s": round(obs.max_round_trip_s, 4),
                "max_beat_gap_s": round(obs.max_beat_gap_s, 4),
                "left": sorted(obs.left),
            }

    # -- round trips (may block on a silent store) --------------------------------------

    def _round_trips(self) -> None:
        store: StoreLike | None = None
        last_beat: float | None = None
        keys = [self.key(p) for p in self.peers]
        warned = False
        while not self._stop.is_set():
            keep_running = self.keep_running
            if keep_running is not None and not keep_running():
                self._stop.set()  # leaves the loop and marks this rank as left
                break
            started = time.monotonic()
            try:
                if store is None:
                    store = self._connect()
                    store.set(self.host_key(self.rank), self.self_info)
                    if self.nodes is not None:
                        store.set(self.node_key(self.rank), self.nodes.node_id)
                    for key in keys:  # create missing counters, so multi_get never waits
                        if not store.check([key]):  # (an add to a malformed one breaks
                            store.add(key, 0)  # the connection)
                    self._repair_own(store)
                store.add(self.key(self.rank), 1)
                beat_at = time.monotonic()
                values = store.multi_get(keys)
                hosts = self._read_hosts(store)
                if self.nodes is not None:
                    self._read_nodes_of(store)
                self._record(values, hosts, started, beat_at, last_beat)
                last_beat = beat_at
            except Exception as exc:
                store = None
                with self._lock:
                    assert self._observed is not None
                    self._observed.errors += 1
                if not warned:
                    logger.warning(
                        "rank %d: heartbeat through %s failed (%s); retrying",
                        self.rank, self.address.describe(), exc,
                    )  # fmt: skip
                    warned = True
            if self._store_host_left():
                logger.info("rank %d: the store host left; heartbeat stops", self.rank)
                return
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))
        if store is not None:
            with contextlib.suppress(Exception):
                store.add(self.key(self.rank), LEFT)

    def _warn_malformed(self, key: str, raw: bytes | str) -> None:
        """Say once per key that a store value was not a counter."""
        if key in self._malformed:
            return
        self._malformed.add(key)
        logger.warning(
            "rank %d: heartbeat store key %s holds %r, not a counter; ignored",
            self.rank, key, raw[:40],
        )  # fmt: skip

    def _repair_own(self, store: StoreLike) -> None:
        """This rank's counter holds something that is not a counter (anyone who reaches the
        store can write it): rewrite it, said at WARNING. Every ``add`` to it failed until
        then, and the peers would have taken this rank for silent."""
        key = self.key(self.rank)
        if not store.check([key]):
            return
        raw = store.get(key)
        if parse_counter(raw) is None:
            self._warn_malformed(key, raw)
            store.set(key, "1")

    def _read_hosts(self, store: StoreLike) -> dict[int, str]:
        obs = self._observed
        assert obs is not None
        out: dict[int, str] = {}
        for peer in self.peers:
            if peer in obs.hosts:
                continue
            key = self.host_key(peer)
            if store.check([key]):
                out[peer] = store.get(key).decode(errors="replace")
        return out

    def _read_nodes_of(self, store: StoreLike) -> None:
        """The node ids the peers (and the store's host) published, once each."""
        obs = self._observed
        assert obs is not None
        wanted = [*self.peers]
        host = self.address.host_rank
        if host is not None and host != self.rank and host not in wanted:
            wanted.append(host)
        for peer in wanted:
            if peer in obs.node_of:
                continue
            key = self.node_key(peer)
            if not store.check([key]):
                continue
            raw = store.get(key)
            node = node_id_text(raw)
            if node is None:
                self._warn_malformed(key, raw)
                continue
            with self._lock:
                obs.node_of[peer] = node

    def _node_reads(self) -> None:
        """Read the peers' node keep-alives every interval (a thread of its own: the
        rendezvous store may stop answering without the process group's store doing so)."""
        channel = self.nodes
        assert channel is not None
        store: StoreLike | None = None
        warned = False
        while not self._stop.wait(self.interval_s):
            if self.nodes is None:
                return  # turned off by a new owner
            obs = self._observed
            assert obs is not None
            with self._lock:
                nodes = sorted(set(obs.node_of.values()))
            if not nodes:
                continue
            try:
                if store is None:
                    store = self._connect_nodes()
                keys = [channel.key(n) for n in nodes]
                if store.check(keys):
                    present = list(zip(nodes, keys))
                else:  # a node that has not written one yet: read the others
                    present = [(n, k) for n, k in zip(nodes, keys) if store.check([k])]
                values = store.multi_get([k for _, k in present]) if present else []
            except Exception as exc:
                store = None
                if not warned:
                    logger.warning(
                        "rank %d: reading node keep-alives from %s failed (%s); judging by "
                        "heartbeats alone until it answers",
                        self.rank, channel.describe(), exc,
                    )  # fmt: skip
                    warned = True
                continue
            now = time.monotonic()
            with self._lock:
                obs.node_ok = now
                for (node, key), raw in zip(present, values):
                    counter = keepalive_counter(raw)
                    if counter is None:
                        self._warn_malformed(key, raw)
                        continue
                    if obs.node_values.get(node) != counter:
                        obs.node_values[node] = counter
                        obs.node_seen[node] = now
                    if len(raw) <= MAX_KEEPALIVE_BYTES:
                        obs.node_raw[node] = bytes(raw)

    def _record(
        self,
        values: list[bytes],
        hosts: dict[int, str],
        started: float,
        beat_at: float,
        last_beat: float | None,
    ) -> None:
        now = time.monotonic()
        with self._lock:
            obs = self._observed
            assert obs is not None
            obs.last_ok = now
            obs.beats += 1
            obs.hosts.update(hosts)
            obs.max_round_trip_s = max(obs.max_round_trip_s, now - started)
            if last_beat is not None:
                obs.max_beat_gap_s = max(obs.max_beat_gap_s, beat_at - last_beat)
            for peer, raw in zip(self.peers, values):
                value = parse_counter(raw)
                if value is None:  # not a counter: no news from that peer
                    self._warn_malformed(self.key(peer), raw)
                    continue
                if value >= LEFT:
                    obs.left.add(peer)
                    continue
                previous = obs.values.get(peer)
                obs.values[peer] = value
                # Alive = the counter moved while this rank watched (a first value may
                # be a leftover; a peer that has not started yet reads 0).
                if previous is not None and value != previous:
                    obs.last_seen[peer] = now

    def _store_host_left(self) -> bool:
        host = self.address.host_rank
        if host is None or host == self.rank:
            return False
        with self._lock:
            assert self._observed is not None
            return host in self._observed.left

    # -- judging ------------------------------------------------------------------------

    def judge(self, now: float, baseline: float) -> SilentVerdict | None:
        """The verdict at ``now``, ignoring anything before ``baseline`` (a self-stall)."""
        return self._assess(now, baseline)[0]

    def _assess(
        self, now: float, baseline: float
    ) -> tuple[SilentVerdict | None, list[StallNotice]]:
        """The verdict at ``now`` (ignoring anything before ``baseline``), and the peers
        that are stalled while their nodes live (:func:`peer_status`)."""
        with self._lock:
            obs = self._observed
            assert obs is not None
            last_ok = obs.last_ok
            seen = {p: max(t, baseline) for p, t in obs.last_seen.items() if p not in obs.left}
            hosts = dict(obs.hosts)
            host_left = self.address.host_rank in obs.left
            node_of = dict(obs.node_of)
            node_seen = dict(obs.node_seen)
            node_ok = obs.node_ok
            nodes_on = self.nodes is not None
        # Node keep-alives witness only while this rank reads them: a rendezvous store that
        # stopped answering here (this node is the cut one) leaves the peer bound alone.
        witnessing = nodes_on and node_ok is not None and now - node_ok <= self.node_timeout_s

        def node_age(rank: int | None) -> float | None:
            node = node_of.get(rank) if witnessing and rank is not None else None
            seen_at = node_seen.get(node) if node is not None else None
            return None if seen_at is None else now - max(seen_at, baseline)

        store_age = now - max(last_ok, baseline)
        host = self.address.host_rank
        if self.judge_store and not host_left:
            status = store_status(
                store_age,
                node_age(host) if host != self.rank else None,
                timeout_s=self.timeout_s,
                node_timeout_s=self.node_timeout_s,
            )
            if status != OK:
                silent = [host] if host is not None and host != self.rank else []
                fast = status == NODE_SILENT
                verdict = self._verdict(
                    silent, hosts, store_age, store_silent=True, node_witness=fast,
                    bound_s=self.node_timeout_s if fast else self.timeout_s,
                )  # fmt: skip
                return verdict, []
        # A peer is silent when its counter has not moved for the bound, and it had already
        # stopped while the store still answered (by more than two heartbeats at the last
        # completed read): a slow or departed store alone is not a peer's fault, and a peer
        # that was silent before the store went away (its host left first) still is. A peer
        # whose node's keep-alive stopped too has a witness that does not depend on this
        # store: the store going away as well (its host rank left on that same peer's
        # silence, a moment earlier) does not excuse it.
        margin = 2 * self.interval_s + 0.25
        statuses: dict[int, str] = {}
        for peer, seen_at in seen.items():
            peer_node_age = node_age(peer)
            node_stopped = peer_node_age is not None and peer_node_age > self.node_timeout_s
            if last_ok - seen_at <= margin and not node_stopped:
                continue
            statuses[peer] = peer_status(
                now - seen_at,
                peer_node_age,
                timeout_s=self.timeout_s,
                node_timeout_s=self.node_timeout_s,
                stall_limit_s=self.stall_limit_s,
            )
        stalled = [
            StallNotice(
                rank=self.rank,
                stalled_rank=peer,
                stalled_s=now - seen[peer],
                host=hosts.get(peer, "host unknown"),
                node=node_of.get(peer, "unknown"),
                limit_s=self.stall_limit_s,
            )
            for peer, status in sorted(statuses.items())
            if status == STALLED
        ]
        silent = sorted(p for p, status in statuses.items() if status in SILENT_STATUSES)
        if not silent:
            return None, stalled
        # The verdict's bound is the one the first silent rank passed.
        first = statuses[silent[0]]
        bound = {NODE_SILENT: self.node_timeout_s, STALL_LIMIT: self.stall_limit_s}.get(
            first, self.timeout_s
        )
        verdict = self._verdict(
            silent, hosts, now - seen[silent[0]], store_silent=False,
            node_witness=first == NODE_SILENT, bound_s=bound,
        )  # fmt: skip
        return verdict, stalled

    def _verdict(
        self,
        silent: list[int],
        hosts: dict[int, str],
        silent_s: float,
        *,
        store_silent: bool,
        node_witness: bool = False,
        bound_s: float | None = None,
    ) -> SilentVerdict:
        return SilentVerdict(
            rank=self.rank,
            silent_ranks=silent,
            hosts={r: hosts.get(r, "host unknown: no heartbeat seen") for r in silent},
            silent_s=silent_s,
            bound_s=self.timeout_s if bound_s is None else bound_s,
            store_silent=store_silent,
            store=self.address.describe(),
            node_witness=node_witness,
        )

    def _monitor(self) -> None:
        previous = time.monotonic()
        baseline = previous
        while not self._stop.wait(min(self.interval_s, JUDGE_EVERY_S)):
            now = time.monotonic()
            if now - previous > min(self.interval_s, JUDGE_EVERY_S) + SELF_STALL_S:
                logger.warning(
                    "rank %d: heartbeat threads did not run for %.1fs (this process was "
                    "stalled); not judging peers on that gap",
                    self.rank, now - previous,
                )  # fmt: skip
                baseline = now
            previous = now
            verdict, stalled = self._assess(now, baseline)
            self._say_stalls(stalled)
            if verdict is not None:
                self._act(verdict)
                return

    def _say_stalls(self, stalled: list[StallNotice]) -> None:
        """Say each stall once (WARNING and ``on_stall``); and, at INFO, a stalled peer
        whose heartbeat moves again."""
        obs = self._observed
        assert obs is not None
        with self._lock:
            said = dict(obs.stalled)
            resumed = [p for p, at in said.items() if obs.last_seen.get(p, at) > at]
            for peer in resumed:
                del obs.stalled[peer]
            new = [n for n in stalled if n.stalled_rank not in obs.stalled]
            for notice in new:
                obs.stalled[notice.stalled_rank] = obs.last_seen.get(notice.stalled_rank, 0.0)
        for peer in resumed:
            logger.info("rank %d: rank %d sends heartbeats again", self.rank, peer)
        for notice in new:
            logger.warning("%s", notice.message())
            if self.on_stall is not None:
                call_bounded(self.on_stall, notice, name="elastic-heartbeat-on-stall",
                             limit_s=ON_SILENT_LIMIT_S,
                             what=f"rank {self.rank}: heartbeat on_stall callback")  # fmt: skip

    def _act(self, verdict: SilentVerdict) -> None:
        self.verdict = verdict
        message = verdict.message()
        logger.error("%s", message)
        if not logging.getLogger().handlers:
            print(message, file=sys.stderr, flush=True)
        self._mark_departed(verdict)
        if self.on_silent is not None:
            call_bounded(self.on_silent, verdict, name="elastic-heartbeat-on-silent",
                         limit_s=ON_SILENT_LIMIT_S,
                         what=f"rank {self.rank}: heartbeat on_silent callback")  # fmt: skip
        if not self.exit_process:
            self._stop.set()
            return
        leave_from_monitor(self.exit_code)

    def _mark_departed(self, verdict: SilentVerdict) -> None:
        """After a verdict that the node keep-alives witnessed, leave each silent node's
        last-read keep-alive at :func:`elastic.nodes.departed_key`: the re-round takes the
        node for gone while its keep-alive still reads that (it does not wait for the
        rendezvous's own bound, ``keep_alive_timeout``). Best effort, bounded."""
        channel = self.nodes
        if channel is None or not verdict.node_witness or verdict.store_silent:
            return
        with self._lock:
            obs = self._observed
            assert obs is not None
            nodes = {obs.node_of.get(rank) for rank in verdict.silent_ranks} - {None}
            marks = {channel.departed_key(n): obs.node_raw[n] for n in nodes if n in obs.node_raw}
        if not marks:
            return

        def write(items: dict[str, bytes]) -> None:
            store = self._connect_nodes()
            for key, raw in items.items():
                store.set(key, raw.decode("ascii", "replace"))

        call_bounded(write, marks, name=f"elastic-heartbeat-departed-rank{self.rank}",
                     limit_s=DEPARTED_LIMIT_S,
                     what=f"rank {self.rank}: marking the silent nodes departed")  # fmt: skip

