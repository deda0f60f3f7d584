"""Separate hosts on one machine: Linux network namespaces on a virtual bridge.

For end-to-end tests that need agents on different addresses, and failures that real
networks have and loopback does not: a link that drops packets without resetting
connections. :class:`VirtualNetwork` creates a bridge in a namespace of its own and,
per host, a namespace joined to the bridge by a veth pair (``eth0`` inside, with its
own ``10.x.y.z/24`` address). Processes run in a host with ``host.wrap(cmd)``
(``ip netns exec NS ...``, which execs, so the pid is the command's own).

- ``cut(host)`` sets the host's bridge port down: the switch side of the cable. The
  host's packets and its peers' packets to it are dropped; no RST, no ICMP error.
- ``restore(host)`` sets it up again.
- ``close()`` deletes every namespace this object created (the bridge's namespace
  takes the veth pairs with it). Names are unique per object (``et`` + 6 random hex
  digits), so concurrent tests never share one, and ``close`` never touches a
  namespace it did not create.

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and ``ip`` from iproute2.
:func:`netns_unavailable` says why namespaces cannot be used here (for a test
skip), or None.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

IFNAME = "eth0"
"""Interface name of every host on the bridge (``GLOO_SOCKET_IFNAME``)."""
_PERMISSION_MARKERS = ("Operation not permitted", "Permission denied", "must be root")


class NetnsError(RuntimeError):
    """An ``ip`` command failed."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be used on this machine (a skip reason), or None.

    Only a permission error counts (not root, no CAP_SYS_ADMIN, a sandbox that forbids
    ``unshare``); any other failure of ``ip netns add`` raises, so a broken setup is an
    error rather than a silent skip.
    """
    if shutil.which("ip") is None:
        raise NetnsError("`ip` (iproute2) is not installed: apt-get install iproute2")
    probe = f"etprobe{secrets.token_hex(3)}"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode == 0:
        _ip("netns", "del", probe, check=False)
        return None
    err = result.stderr.strip()
    if any(marker in err for marker in _PERMISSION_MARKERS):
        return f"`ip netns add` is not permitted here ({err}); namespaces need root"
    raise NetnsError(f"ip netns add {probe}: {err}")


@dataclass
class Host:
    """One machine: a namespace with ``eth0`` on the bridge."""

    name: str
    netns: str
    addr: str
    port: str
    """Its port on the bridge (in the bridge's namespace): what ``cut`` sets down."""

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *cmd]


@dataclass
class VirtualNetwork:
    """A bridge and the hosts on it, all in namespaces created (and deleted) here."""

    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    hosts: list[Host] = field(default_factory=list)
    _created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        value = int(self.tag, 16)
        # 10.A.B.0/24, A in 100..227: a subnet per network, for readable logs (the
        # namespaces are isolated, so two tests with the same subnet would not clash).
        self.subnet = f"10.{100 + (value >> 8) % 128}.{value % 256}"
        self.bridge_ns = f"et{self.tag}br"
        try:
            self._netns_add(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def _netns_add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def add_host(self, name: str) -> Host:
        """A new namespace on the bridge with the next free address (``.2``, ``.3``, ...)."""
        index = len(self.hosts) + 2
        if index > 254:
            raise ValueError("a VirtualNetwork holds at most 253 hosts")
        netns = f"et{self.tag}n{index}"
        inner, port = f"et{self.tag}i{index}", f"et{self.tag}p{index}"
        addr = f"{self.subnet}.{index}"
        self._netns_add(netns)
        # Create the pair inside the host's namespace, so nothing is left in the root
        # namespace if a later step fails (deleting the namespace deletes the pair).
        _ip("-n", netns, "link", "add", inner, "type", "veth", "peer", "name", port)
        _ip("-n", netns, "link", "set", port, "netns", self.bridge_ns)
        _ip("-n", netns, "link", "set", inner, "name", IFNAME)
        _ip("-n", netns, "addr", "add", f"{addr}/24", "dev", IFNAME)
        _ip("-n", netns, "link", "set", IFNAME, "up")
        _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
        _ip("-n", self.bridge_ns, "link", "set", port, "up")
        host = Host(name=name, netns=netns, addr=addr, port=port)
        self.hosts.append(host)
        return host

    def cut(self, host: Host) -> None:
        """Pull the host's cable at the switch: packets dropped both ways, no reset."""
        _ip("-n", self.bridge_ns, "link", "set", host.port, "down")

    def restore(self, host: Host) -> None:
        _ip("-n", self.bridge_ns, "link", "set", host.port, "up")

    def namespaces(self) -> list[str]:
        """The namespaces this network created and has not deleted yet."""
        return list(self._created)

    def close(self) -> None:
        """Delete every namespace created here (hosts first, then the bridge's)."""
        for name in reversed(self._created):
            with contextlib.suppress(NetnsError, subprocess.TimeoutExpired):
                _ip("netns", "del", name)
        self._created.clear()

    def __enter__(self) -> VirtualNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
