"""``ft``: a rendezvous backend for stock torchrun (``--rdzv_backend=ft``).

Registered through the ``torchrun.handlers`` entry point (see pyproject.toml), so a
job keeps torchrun and its agent and only swaps the rendezvous::

    torchrun --rdzv_backend=ft --rdzv_endpoint=HOST:PORT --rdzv_id=JOB --nnodes=2:4 ...

It runs over a TCPStore at the endpoint, hosted by the agent whose address matches
it (or ``--rdzv_conf is_host=1``), or standalone when one already listens there.
Differences from c10d a user sees: rounds finish in well under a second (a waiting
node checks the round's result every ``poll_interval``, 50 ms, not once a second), a re-round after a
failure finishes as soon as every live member of the previous round has rejoined, a
dead agent is left out as soon as its keep-alive is older than ``keep_alive_timeout``,
and ``use_agent_store`` is false: workers build their own store from
``MASTER_ADDR``/``MASTER_PORT``, so ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` is never
needed. After each round the agent puts the store's address and its node id in its
environment, which torchrun copies into the workers it starts (:mod:`elastic.nodes`):
their peer failure detector reads the nodes' keep-alives as a second witness.

Store layout, all under ``ft/<run_id>/`` (the run id fences jobs apart):

- ``round``: the newest round number (a counter; a joiner moves it past a finished round);
- ``r<R>/n``: join counter of round R; ``r<R>/s<i>``: the node id holding slot i;
- ``r<R>/members``: the round's result, written once with ``compare_set``: a JSON
  list of node ids (rank = position), or ``"closed"``;
- ``hb/<node id>``: keep-alive, ``"<counter> <unix time>"``, rewritten every
  ``keep_alive_interval`` by a thread with its own connection;
- ``departed/<node id>``: written by a worker whose detector judged that node frozen or
  cut off (:mod:`elastic.nodes`): the keep-alive value it last saw. A re-round does not
  wait for an absent member whose keep-alive still reads that value;
- ``closed``: present once the job is over (``set_closed``, ``shutdown``);
- ``r<R>/agent/``: the prefix of the store handed to the agent for round R.

A round closes when (a) ``max_nodes`` have joined, or (b) at least ``min_nodes``
have joined and every live member of the previous round is among them, or (c) at
least ``min_nodes`` have joined and ``last_call_timeout`` has passed since this node
saw ``min_nodes`` (first round only; a re-round waits up to ``rejoin_timeout`` for
live members instead). The first node to see one of these writes the member list,
leaving out any joiner whose keep-alive has gone stale since it joined, itself first
(rank 0 is a node alive at the close; the others in join order). The round's
first three joiners evaluate it every ``poll_interval``; the others only look for its
result then (one store request) and evaluate it once per ``decide_interval``, in case
all three died, so a round of hundreds of nodes does not load the store. A node
not on it (it came late, or was taken for dead) joins the next round, which makes
the members' ``num_nodes_waiting`` non-zero and so restarts them into it.

``--rdzv_conf`` keys (defaults in :class:`FtConfig`): ``is_host``,
``last_call_timeout``, ``join_timeout``, ``keep_alive_interval``,
``keep_alive_timeout``, ``rejoin_timeout``, ``poll_interval``, ``decide_interval``,
``connect_timeout``, ``read_timeout``
(seconds, floats allowed); torchrun's own ``timeout`` and ``rank`` and ``store_type=tcp``
are accepted; any other key is a ``ValueError`` naming it (a misspelt setting would
otherwise be ignored). A store that cannot be reached raises
``RendezvousConnectionError`` within ``connect_timeout``; an endpoint whose name does
not resolve, within ``RESOLVE_GRACE_S`` (10 s).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.utils import (
    _matches_machine_hostname,
    parse_rendezvous_endpoint,
)

from elastic.nodes import departed_key, export_node, keepalive_key

log = logging.getLogger(__name__)

BACKEND = "ft"
DEFAULT_PORT = 29400
CLOSED = "closed"
DECIDERS = 3
"""The first joiners of a round, which evaluate it every ``poll_interval``."""


OTHER_CONF_KEYS = frozenset({"is_host", "store_type", "timeout", "rank"})
"""``--rdzv_conf`` keys that are not timing knobs: ``is_host``; ``store_type`` (``tcp``
only); ``timeout`` (torchrun's ``--rdzv-timeout``, always passed; the join bound here is
``join_timeout``) and ``rank`` (``--node-rank``), which torchrun adds itself."""


@dataclass(frozen=True)
class FtConfig:
    """Timing knobs, all in seconds; each can be set with ``--rdzv_conf key=value``."""

    last_call_timeout: float = 0.3
    """After min nodes are there, how long a first round (or a growing one) waits for more."""
    join_timeout: float = 600.0
    """How long ``next_rendezvous`` may wait before RendezvousTimeoutError (as c10d)."""
    keep_alive_interval: float = 0.2
    keep_alive_timeout: float = 1.5
    """A node whose keep-alive has not moved for this long is left out of the next round."""
    rejoin_timeout: float = 3.0
    """In a re-round, how long to wait for a member of the last round that is alive but
    has not rejoined yet before the round closes without it."""
    poll_interval: float = 0.05
    """How often a waiting node checks whether its round is complete."""
    decide_interval: float = 1.0
    """How often a waiting node that is not one of the round's first joiners (which
    evaluate it every poll) evaluates whether the round can close."""
    connect_timeout: float = 60.0
    """Bound on reaching the store at the endpoint (RendezvousConnectionError after it)."""
    read_timeout: float = 60.0

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> FtConfig:
        known = set(cls.__dataclass_fields__) | OTHER_CONF_KEYS
        unknown = sorted(set(params.config) - known)
        if unknown:
            raise ValueError(
                f"--rdzv_conf {', '.join(unknown)}: not a setting of the ft rendezvous "
                f"backend; its settings: {', '.join(sorted(known))}"
            )
        store_type = str(params.get("store_type", "tcp")).strip().lower()
        if store_type != "tcp":
            raise ValueError(
                f"--rdzv_conf store_type={params.get('store_type')!r}: the ft rendezvous "
                "backend runs on a TCP store only (store_type=tcp)"
            )
        values = {}
        for name in cls.__dataclass_fields__:
            raw = params.get(name)
            if raw is None:
                continue
            try:
                value = float(raw)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"--rdzv_conf {name}={raw!r} is not a number of seconds") from exc
            if value <= 0:
                raise ValueError(f"--rdzv_conf {name} must be positive, got {raw!r}")
            values[name] = value
        return cls(**values)


def connect_store(
    params: RendezvousParameters, config: FtConfig
) -> tuple[TCPStore, socket.socket | None]:
    """The TCPStore at ``params.endpoint``: hosted here when this is the host (``is_host``,
    else the endpoint names this machine and the port is free), a client otherwise; and the
    socket a hosted store serves on (keep it open as long as the store), if any."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    deadline = time.monotonic() + config.connect_timeout
    cfg_is_host = params.get_as_bool("is_host")
    is_host = cfg_is_host if cfg_is_host is not None else _matches_machine_hostname(host)
    attempts = [True, False] if is_host and cfg_is_host is None else [is_host]
    last: Exception | None = None
    for as_server in attempts:
        try:
            if not as_server:
                # TCPStore's client retries past its timeout (twice it, and a C++ trace
                # per try): reach the port first, within what is left of the bound.
                reach(host, port, deadline)
            listener = listen_socket(host, port) if as_server else None
            left = max(deadline - time.monotonic(), 1.0)
            store = TCPStore(
                host,
                port,
                is_master=as_server,
                multi_tenant=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=left if not as_server else 30),
                **({"master_listen_fd": listener.fileno()} if listener is not None else {}),
            )
            return store, listener
        except socket.gaierror as exc:
            raise RendezvousConnectionError(
                f"ft rendezvous: the endpoint host {host!r} does not resolve ({exc}); check "
                "--rdzv_endpoint"
            ) from exc
        except (RuntimeError, ValueError, TimeoutError, OSError) as exc:
            last = exc
    raise RendezvousConnectionError(
        f"ft rendezvous: could not reach the store at {host}:{port} within "
        f"{config.connect_timeout:g} s (is the host agent or the store process running?): {last}"
    ) from last


RESOLVE_GRACE_S = 10.0
"""How long a name that does not resolve is retried (a cluster's DNS entry for a service
made at the same time as the job may lag it by seconds) before it is an error."""


def reach(host: str, port: int, deadline: float) -> None:
    """Return once a TCP connection to ``host:port`` succeeds (then closed); retry a
    refused or unanswered one until ``deadline`` (``time.monotonic()``), then raise
    ``TimeoutError``. A name that does not resolve raises ``socket.gaierror`` once it
    has not for :data:`RESOLVE_GRACE_S` (or at the deadline, if sooner)."""
    last: Exception | None = None
    resolve_by = min(deadline, time.monotonic() + RESOLVE_GRACE_S)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer from {host}:{port}: {last}")
        try:
            with socket.create_connection((host, port), timeout=min(left, 5.0)):
                return
        except socket.gaierror as exc:
            if time.monotonic() >= resolve_by:
                raise
            last = exc
        except OSError as exc:
            last = exc
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))


def listen_socket(host: str, port: int) -> socket.socket | None:
    """A socket listening on the endpoint's own address, for the store server to use.

    TCPStore alone listens on every interface; the rendezvous store needs only the address
    its clients are given (:func:`bind_address` decides which, or None: every interface,
    as TCPStore does). Raises ``OSError`` when the port is taken (another agent hosts the
    store) or the address is not this host's.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    address = bind_address(host, [info[4][0] for info in infos])
    if address is None:
        return None
    family, _, _, _, sockaddr = next(i for i in infos if i[4][0] == address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def bind_address(host: str, addresses: list[str]) -> str | None:
    """The one address to listen on for endpoint ``host`` (resolved to ``addresses``), or
    None for every interface: a name resolving to several addresses, or a name (not an
    address, not ``localhost``) resolving to loopback here. Debian maps the machine's own
    name to 127.0.1.1, which other hosts could not reach."""
    literal = _is_ip_literal(host)
    distinct = sorted(set(addresses))
    if not distinct or (len(distinct) != 1 and not literal):
        return None
    address = host.strip("[]") if literal else distinct[0]
    if not literal and host != "localhost" and _is_loopback(address):
        return None
    return address


def _is_ip_literal(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host.strip("[]"))
            return True
        except OSError:
            continue
    return False


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


T = TypeVar("T")

_STORE_FAILURES = (RuntimeError, OSError, TimeoutError)
"""What a TCPStore call raises when its server went away (``DistNetworkError`` and
``DistStoreError`` are RuntimeErrors); the rendezvous's own errors are not among them."""


def _through_store(method: Callable[..., T]) -> Callable[..., T]:
    """A handler method whose store failures are ``RendezvousConnectionError`` naming the
    store, as torch's handler contract has it (its c10d backend does the same), not a raw
    socket error from inside the store client."""

    @functools.wraps(method)
    def call(self: FtRendezvousHandler, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, *args, **kwargs)
        except _STORE_FAILURES as exc:
            raise RendezvousConnectionError(
                f"the ft rendezvous store {self.store_address} failed during "
                f"{method.__name__}: {exc}. Its host is gone or unreachable; a store run "
                "in a process of its own outlives any agent (docs/launching.md)"
            ) from exc

    return call


class FtRendezvousHandler(RendezvousHandler):
    """One agent's side of the ``ft`` rendezvous (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        *,
        config: FtConfig | None = None,
        local_addr: str | None = None,
        node_id: str | None = None,
        heartbeat_store: Store | None = None,
        listener: socket.socket | None = None,
        export_to: MutableMapping[str, str] | None = None,
    ) -> None:
        if min_nodes < 1 or max_nodes < min_nodes:
            raise ValueError(f"bad node range {min_nodes}:{max_nodes}")
        self._store = store
        self._agent_base = store  # what the agent's PrefixStore wraps: a real Store
        self._hb_store = heartbeat_store
        self._run_id = run_id
        self._min = min_nodes
        self._max = max_nodes
        self.config = config or FtConfig()
        self._local_addr = local_addr
        host = local_addr or socket.gethostname()
        self.node_id = node_id or f"{host}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self._prefix = f"ft/{run_id}/"
        self._round: int | None = None  # the round this node is a member of
        self._hb_thread: threading.Thread | None = None
        self._hb_stop = threading.Event()
        self._shut = False
        self._malformed: set[str] = set()
        self._listener = listener  # the hosted store serves on it: kept open while we live
        self._export_to = export_to
        """Where each round tells the workers about this node's keep-alive (torchrun's agent:
        ``os.environ``, which it copies into every worker; None: nowhere)."""

    # -- keys -----------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return self._prefix + name

    def _rkey(self, rnd: int, name: str) -> str:
        return f"{self._prefix}r{rnd}/{name}"

    # -- RendezvousHandler ----------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self._run_id

    @property
    def store_address(self) -> str:
        """``host:port`` of the rendezvous store (what its messages name)."""
        host, port = getattr(self._store, "host", None), getattr(self._store, "port", None)
        return f"{host}:{port}" if host is not None else "(address unknown)"

    @property
    def use_agent_store(self) -> bool:
        return False

    @_through_store
    def is_closed(self) -> bool:
        return self._store.check([self._key(CLOSED)])

    @_through_store
    def set_closed(self) -> None:
        self._store.set(self._key(CLOSED), "1")
        # Wake every node waiting in the open round: its result becomes "closed".
        rnd = int(self._store.add(self._key("round"), 0))
        for r in (rnd, rnd + 1):
            self._store.compare_set(self._rkey(r, "members"), "", CLOSED)

    @_through_store
    def num_nodes_waiting(self) -> int:
        """Live nodes that joined the round after this node's (one request while none
        did; a joiner that died before the round closed is not counted)."""
        if self._round is None:
            return 0
        nxt = self._round + 1
        count = int(self._store.add(self._rkey(nxt, "n"), 0))
        if count == 0:
            return 0
        joined = list(self._read_slots(nxt, list(range(1, count + 1))).values())
        return len(self._alive_of(joined))

    def shutdown(self) -> bool:
        self._stop_heartbeat()
        if self._shut:
            return True
        self._shut = True
        try:
            self.set_closed()
            return True
        except Exception as exc:  # store gone: nothing left to close
            log.warning("ft rendezvous shutdown could not reach the store: %s", exc)
            return False

    @_through_store
    def next_rendezvous(self) -> RendezvousInfo:
        deadline = time.monotonic() + self.config.join_timeout
        self._start_heartbeat()
        if self.is_closed():
            raise RendezvousClosedError()
        rnd = self._target_round(self._round)
        while True:
            members = self._join(rnd, deadline)
            if self.node_id in members:
                break
            rnd = self._target_round(rnd)  # left out of that round: the next one
        self._round = rnd
        rank = members.index(self.node_id)
        store = PrefixStore(self._rkey(rnd, "agent/"), self._agent_base)
        info = RendezvousStoreInfo.build(rank, store, self._local_addr)
        self._export_node()
        log.info(
            "ft rendezvous %s round %d complete: rank %d of %d",
            self._run_id,
            rnd,
            rank,
            len(members),
        )
        return RendezvousInfo(store, rank, len(members), info)

    def _export_node(self) -> None:
        """Tell the workers torchrun starts next where this node's keep-alive is: the
        agent's environment is what torchrun copies into each of them (elastic/nodes.py;
        their peer failure detector reads it)."""
        host, port = getattr(self._store, "host", None), getattr(self._store, "port", None)
        if self._export_to is None:
            return
        if isinstance(host, str) and host and isinstance(port, int) and port > 0:
            export_node(self._export_to, host, port, self.node_id)

    # -- the round ------------------------------------------------------------------------

    def _target_round(self, after: int | None) -> int:
        """The first round past ``after`` whose result is not written yet (moving
        ``round`` on to it)."""
        rnd = int(self._store.add(self._key("round"), 0))
        if after is not None and rnd <= after:
            rnd = after + 1
        while self._store.check([self._rkey(rnd, "members")]):
            rnd += 1
        current = int(self._store.add(self._key("round"), 0))
        while current < rnd:
            current = int(self._store.compare_set(self._key("round"), str(current), str(rnd)))
        return rnd

    def _members_of(self, rnd: int) -> list[str] | None:
        key = self._rkey(rnd, "members")
        if rnd < 0 or not self._store.check([key]):
            return None
        value = self._store.get(key)
        return None if value == CLOSED.encode() else self._parse_members(key, value)

    def _join(self, rnd: int, deadline: float) -> list[str]:
        store = self._store
        slot = int(store.add(self._rkey(rnd, "n"), 1))
        store.set(self._rkey(rnd, f"s{slot}"), self.node_id)
        previous = self._members_of(rnd - 1) or []
        liveness = Liveness(self.config.keep_alive_timeout)
        seen: dict[int, str] = {}
        min_seen_at: float | None = None
        # The first DECIDERS joiners evaluate the round every poll; the others only watch
        # for its result and evaluate once per ``decide_interval`` (in case every decider
        # died): what a waiting node costs the store stays one request per poll.
        decider = slot <= DECIDERS
        next_decision = 0.0
        result_key = self._rkey(rnd, "members")
        while True:
            now = time.monotonic()
            if decider or now >= next_decision:
                next_decision = now + self.config.decide_interval
                count = int(store.add(self._rkey(rnd, "n"), 0))
                missing = [i for i in range(1, count + 1) if i not in seen]
                if missing:
                    seen.update(self._read_slots(rnd, missing))
                joined = [seen[i] for i in sorted(seen)]
                if len(joined) >= self._min and min_seen_at is None:
                    min_seen_at = now
                ready = len(joined) >= self._max
                if not ready and min_seen_at is not None:
                    waited = now - min_seen_at
                    if previous:
                        # a re-round: done once every live member of the last round is back
                        absent = [p for p in previous if p not in joined]
                        ready = not any(self._still_alive(liveness, p) for p in absent)
                        ready = ready or waited >= self.config.rejoin_timeout
                    else:
                        ready = waited >= self.config.last_call_timeout
                if ready:
                    live = self._alive_of(joined)  # a joiner that died since is left out
                    if self.node_id in live:
                        # The node that closes the round is rank 0: it is alive now, where
                        # a joiner that died a moment ago still looks alive, and as rank 0
                        # the others would wait on its address until they time out.
                        live.remove(self.node_id)
                        live.insert(0, self.node_id)
                    if len(live) >= self._min:
                        store.compare_set(result_key, "", json.dumps(live[: self._max]))
            left = deadline - time.monotonic()
            result = self._wait_result(rnd, min(self.config.poll_interval, left))
            if result is not None:
                return result
            if time.monotonic() >= deadline:
                raise RendezvousTimeoutError(
                    f"ft rendezvous {self._run_id}: round {rnd} did not complete within "
                    f"{self.config.join_timeout:g} s ({len(seen)} of min {self._min} nodes)"
                )

    def _wait_result(self, rnd: int, timeout: float) -> list[str] | None:
        """The round's member list if written, else None after ``timeout`` s.

        A poll (``check`` then ``sleep``), not ``TCPStore.wait``: a wait that times out
        logs a C++ warning per timeout and leaves the connection busy until the server
        answers the cancelled wait, which stalled rounds by seconds when tried."""
        key = self._rkey(rnd, "members")
        if not self._store.check([key]):
            time.sleep(max(timeout, 0.0))
            return None
        value = self._store.get(key)
        if value == CLOSED.encode():
            raise RendezvousClosedError()
        members = self._parse_members(key, value)
        if members is None:
            time.sleep(max(timeout, 0.0))
        return members

    def _read_slots(self, rnd: int, slots: list[int]) -> dict[int, str]:
        """Node ids of the slots already written (a joiner writes its id right after it
        takes a slot; one that died in between simply stays unwritten)."""
        keys = [self._rkey(rnd, f"s{i}") for i in slots]
        if self._store.check(keys):  # the usual case: all written, one request each way
            present = list(zip(slots, keys))
        else:
            present = [(i, k) for i, k in zip(slots, keys) if self._store.check([k])]
        if not present:
            return {}
        values = self._store.multi_get([k for _, k in present])
        out = {}
        for (i, key), value in zip(present, values):
            node = _text(value)
            if node is None:
                self._warn_malformed(key, value, "a node id")
            else:
                out[i] = node
        return out

    def _parse_members(self, key: str, value: bytes) -> list[str] | None:
        members = parse_members(value)
        if members is None:
            self._warn_malformed(key, value, "a member list")
        return members

    def _warn_malformed(self, key: str, value: bytes, what: str) -> None:
        """Say once per key that a store value was not what it should be (it is ignored)."""
        if key not in self._malformed:
            self._malformed.add(key)
            log.warning(
                "ft rendezvous: store key %s holds %r, not %s; ignored", key, value[:60], what
            )

    def _alive_of(self, nodes: list[str]) -> list[str]:
        """``nodes`` whose keep-alive is fresh by its wall time (one request). Every
        joiner writes its keep-alive before it takes a slot, so each key is there."""
        if not nodes:
            return []
        values = self._store.multi_get([keepalive_key(self._run_id, n) for n in nodes])
        now = time.time()
        return [
            n
            for n, v in zip(nodes, values)
            if now - _wall_of(_text(v) or "", now) < self.config.keep_alive_timeout
        ]

    # -- keep-alive -----------------------------------------------------------------------

    def _still_alive(self, liveness: Liveness, node: str) -> bool:
        """Whether an absent member of the last round may still come back: its keep-alive
        is fresh (``liveness``), unless a worker judged its node frozen or cut off and left
        the keep-alive value it last saw (:func:`elastic.nodes.departed_key`) which the
        keep-alive still reads: then it has not moved since, and is not waited for."""
        value = self._hb(node)
        if value is not None:
            key = departed_key(self._run_id, node)
            if self._store.check([key]) and _text(self._store.get(key)) == value:
                return False
        return liveness.alive(node, value)

    def _hb(self, node: str) -> str | None:
        key = keepalive_key(self._run_id, node)
        if not self._store.check([key]):
            return None
        return _text(self._store.get(key))

    def _start_heartbeat(self) -> None:
        if self._hb_thread is not None:
            return
        store = self._hb_store
        if store is None:
            store = self._store.clone() if isinstance(self._store, TCPStore) else self._store
        key = keepalive_key(self._run_id, self.node_id)
        store.set(key, f"0 {time.time()}")
        # The thread holds no reference to the handler: a handler dropped without
        # shutdown() is collected, and its finalizer stops the keep-alive.
        stop, interval = self._hb_stop, self.config.keep_alive_interval
        weakref.finalize(self, stop.set)

        def beat() -> None:
            n = 0
            while not stop.wait(interval):
                n += 1
                try:
                    store.set(key, f"{n} {time.time()}")
                except Exception as exc:  # the store is gone; the round will say so
                    log.warning("ft rendezvous keep-alive failed: %s", exc)
                    return

        self._hb_thread = threading.Thread(target=beat, name="ft-rdzv-keepalive", daemon=True)
        self._hb_thread.start()

    def _stop_heartbeat(self) -> None:
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=2)


class Liveness:
    """Whether a node's keep-alive is fresh: dead when its value has not changed for
    ``timeout`` seconds of this process's clock, or when the wall time written in it
    is older than ``timeout`` (this assumes hosts' clocks agree to well under it)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._last: dict[str, tuple[str | None, float]] = {}

    def alive(self, node: str, value: str | None) -> bool:
        now = time.monotonic()
        old = self._last.get(node)
        if old is None or old[0] != value:
            self._last[node] = (value, now)
            old = self._last[node]
        if value is None:
            return now - old[1] < self.timeout
        if time.time() - _wall_of(value, time.time()) > self.timeout:
            return False
        return now - old[1] < self.timeout


def _wall_of(value: str, default: float) -> float:
    """The wall time in a keep-alive value (``"<counter> <unix time>"``); ``default`` for a
    value that is not one (no finite time: "inf" would keep a dead node alive forever)."""
    try:
        wall = float(value.split()[1])
    except (IndexError, ValueError):
        return default
    return wall if math.isfinite(wall) else default


MAX_NODE_ID = 512


def _text(value: bytes) -> str | None:
    """A store value as text, or None when it is not short printable text."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if len(text) <= MAX_NODE_ID and text.isprintable() else None


def parse_members(value: bytes) -> list[str] | None:
    """A round's member list (a JSON list of node ids), or None when the value is not one:
    store values come from anyone who reaches the store."""
    try:
        members = json.loads(value.decode("utf-8")) if len(value) <= 1 << 24 else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if isinstance(members, list) and all(
        isinstance(m, str) and 0 < len(m) <= MAX_NODE_ID for m in members
    ):
        return members
    return None


def create_handler(params: RendezvousParameters) -> FtRendezvousHandler:
    """torchrun's creator for ``--rdzv_backend=ft``."""
    config = FtConfig.from_params(params)
    store, listener = connect_store(params, config)
    store.set_timeout(timedelta(seconds=config.read_timeout))
    # The keep-alive's own connection is made now, not in the first round, where every
    # node would connect at once (a storm of connects waits on the listen backlog).
    heartbeat = store.clone()
    return FtRendezvousHandler(
        store,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        config=config,
        local_addr=params.local_addr,
        heartbeat_store=heartbeat,
        listener=listener,
        export_to=os.environ,
    )
