"""A node's keep-alive as the second witness of the peer failure detector (``ft`` only).

A rank's heartbeat (:mod:`elastic.heartbeat`) is bumped by a Python thread, so anything
that holds the GIL for long (a full garbage collection of a large heap, a C call that
keeps it, a process swapped out) silences it exactly as a frozen node or a cut link
does. Under ``--rdzv_backend=ft`` each torchrun agent already writes a keep-alive to the
rendezvous store every ``keep_alive_interval`` (0.2 s) from its own process, which
trains nothing and holds no large heap. The detector reads the keep-alives of its peers'
nodes and tells the cases apart:

- a peer's heartbeat and its node's keep-alive both stopped for the node bound (1 s):
  the node is frozen or cut off; the peer is silent at once, not after the peer bound;
- its heartbeat stopped but its node's keep-alive goes on: the peer's process is alive
  and stalled; said at WARNING and waited for, up to the stall bound;
- no keep-alive to read (another rendezvous backend, or the rendezvous store does not
  answer this rank): the peer bound alone, as before.

The agent hands the workers what they need through its environment, which torchrun
gives every worker it starts: :data:`ENV_STORE` (the rendezvous store's ``host:port``)
and :data:`ENV_NODE` (the agent's node id); the run id is ``TORCHELASTIC_RUN_ID``. Each
rank publishes its node id beside its heartbeat, so its peers know whose keep-alive to
read. Values read from the store are input from anyone who reaches it: checked, never
trusted to be well formed. Standard library only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

ENV_STORE = "ELASTIC_FT_STORE"
"""``host:port`` of the ``ft`` rendezvous store, set in the agent's environment by
:class:`elastic.rendezvous.FtRendezvousHandler` for the workers it starts."""
ENV_NODE = "ELASTIC_FT_NODE"
"""The agent's node id in the rendezvous (its keep-alive key), set beside :data:`ENV_STORE`."""
ENV_RUN_ID = "TORCHELASTIC_RUN_ID"

DEFAULT_NODE_TIMEOUT_S = 1.0
"""A peer whose heartbeat and whose node's keep-alive both stopped for this long is silent."""
DEFAULT_STALL_LIMIT_S = 60.0
"""A peer whose node lives but whose own heartbeat stopped is waited for this long (a
stall: garbage collection, a call holding the GIL) before it counts as silent."""
MAX_NODE_ID = 512


def keepalive_key(run_id: str, node: str) -> str:
    """The store key of ``node``'s keep-alive in run ``run_id`` (``ft/<run id>/hb/<node>``)."""
    return f"ft/{run_id}/hb/{node}"


def departed_key(run_id: str, node: str) -> str:
    """Where a rank that judged ``node`` frozen or cut off (its rank's heartbeat and its
    keep-alive both stopped) leaves the keep-alive value it last saw
    (``ft/<run id>/departed/<node>``): the re-round that follows need not wait for that
    keep-alive to age past the rendezvous's own bound while it still reads that value."""
    return f"ft/{run_id}/departed/{node}"


def node_id_text(raw: bytes | str) -> str | None:
    """A node id read from a store, or None when it is not short printable text."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError:
        return None
    return text if 0 < len(text) <= MAX_NODE_ID and text.isprintable() else None


def keepalive_counter(raw: bytes | str) -> int | None:
    """The counter of a keep-alive value (``"<counter> <unix time>"``), or None when the
    value is not one: only its changes matter here, never its wall time."""
    try:
        text = raw.decode("ascii") if isinstance(raw, bytes) else raw
        counter = int(text.split()[0])
    except (UnicodeDecodeError, ValueError, IndexError):
        return None
    return counter if 0 <= counter < 1 << 62 else None


@dataclass(frozen=True, slots=True)
class NodeChannel:
    """Where this rank reads node keep-alives, and its own node."""

    host: str
    port: int
    node_id: str
    run_id: str

    def key(self, node: str) -> str:
        return keepalive_key(self.run_id, node)

    def departed_key(self, node: str) -> str:
        return departed_key(self.run_id, node)

    def describe(self) -> str:
        return f"the ft rendezvous store at {self.host}:{self.port}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NodeChannel | None:
        """The channel the agent exported, or None (not under the ``ft`` backend, or a
        value that is not one: then the detector works without node keep-alives)."""
        source = os.environ if env is None else env
        store, node, run_id = source.get(ENV_STORE), source.get(ENV_NODE), source.get(ENV_RUN_ID)
        if not store or not node or not run_id:
            return None
        host, sep, port_text = store.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            return None
        if node_id_text(node) is None:
            return None
        return cls(host=host, port=int(port_text), node_id=node, run_id=run_id)


def export_node(environ: MutableMapping[str, str], host: str, port: int, node_id: str) -> None:
    """Put the channel in ``environ`` (the agent's ``os.environ``, which torchrun copies
    into every worker it starts)."""
    environ[ENV_STORE] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    environ[ENV_NODE] = node_id


def check_node_bounds(node_timeout_s: float, stall_limit_s: float, interval_s: float) -> None:
    """ValueError naming the setting when the bounds cannot work with ``interval_s``."""
    if not math.isfinite(node_timeout_s) or node_timeout_s < 2 * interval_s:
        raise ValueError(
            f"node timeout must be at least twice the heartbeat interval ({interval_s}s), "
            f"got {node_timeout_s}"
        )
    if not math.isfinite(stall_limit_s) or stall_limit_s < node_timeout_s:
        raise ValueError(
            f"stall limit must be a finite number of seconds >= the node timeout "
            f"({node_timeout_s}s), got {stall_limit_s}"
        )
