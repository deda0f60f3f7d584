"""What a launcher and its node's zygote say to each other (standard library only).

One stream connection per worker, over an abstract Unix socket (no file to clean up; it
lives in the network namespace of the agent that started both):

1. launcher -> zygote: one framed JSON request (argv target, environment, working
   directory) carrying the launcher's stdin, stdout and stderr as ``SCM_RIGHTS``.
2. zygote -> launcher: ``{"pid": P}`` once the child is forked.
3. zygote -> launcher: ``{"status": S}`` (a ``waitpid`` status) when the child is gone.

A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

ENV_RUN_ID = "TORCHELASTIC_RUN_ID"
"""Set by torchrun for every worker; its absence means "not under torchrun"."""

_HEADER = struct.Struct(">I")
_MAX_FRAME = 16 << 20
STDIO_FDS = (0, 1, 2)


@dataclass(frozen=True, slots=True)
class Target:
    """What to run: ``python -m module args`` (``module`` set) or ``python path args``."""

    module: str | None
    path: str | None
    args: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"module": self.module, "path": self.path, "args": list(self.args)}

    @staticmethod
    def from_json(raw: dict[str, Any]) -> Target:
        return Target(module=raw.get("module"), path=raw.get("path"), args=list(raw["args"]))


def socket_names(agent_pid: int, run_id: str) -> tuple[str, str]:
    """``(lock, serve)``: abstract socket names of the zygote of one torchrun agent.

    The zygote binds ``lock`` as soon as it starts (only one per agent gets it) and
    ``serve`` once its imports are done, so a launcher that can connect to ``serve``
    never waits for an import.
    """
    key = hashlib.sha256(f"{os.getuid()}:{agent_pid}:{run_id}".encode()).hexdigest()[:24]
    return f"\0warmstart.{key}.lock", f"\0warmstart.{key}"


def send_frame(sock: socket.socket, payload: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(payload).encode()
    frame = _HEADER.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [frame], list(fds))
        frame = frame[sent:]
    if frame:
        sock.sendall(frame)


def recv_frame(sock: socket.socket, with_fds: bool = False) -> tuple[dict[str, Any], list[int]]:
    """One frame (and, with ``with_fds``, the descriptors sent with its first bytes).

    Raises ``EOFError`` when the peer closed the connection before a whole frame.
    """
    fds: list[int] = []
    buf = b""
    if with_fds:
        chunk, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, len(STDIO_FDS))
        if not chunk:
            _close_all(fds)
            raise EOFError("peer closed the connection")
        buf = chunk
    try:
        while len(buf) < _HEADER.size:
            buf += _recv_some(sock)
        (length,) = _HEADER.unpack(buf[: _HEADER.size])
        if length > _MAX_FRAME:
            raise ValueError(f"warmstart: frame of {length} bytes is too large")
        while len(buf) < _HEADER.size + length:
            buf += _recv_some(sock)
        return json.loads(buf[_HEADER.size : _HEADER.size + length]), fds
    except BaseException:
        _close_all(fds)
        raise


def _recv_some(sock: socket.socket) -> bytes:
    chunk = sock.recv(1 << 16)
    if not chunk:
        raise EOFError("peer closed the connection")
    return chunk


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def peer_pid_uid(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid
