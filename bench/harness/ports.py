"""Free TCP ports for the harnesses (emulators, rendezvous stores, MASTER_PORT)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago.

    The socket is closed before returning, so another process may take the port in
    between: callers that bind it later retry or accept the rare collision.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
