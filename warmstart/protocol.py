"""What a launcher and its node's zygote say to each other (standard library only).

One stream connection per worker, over a Unix socket in this user's private directory
(:func:`runtime_dir`: another local user can neither bind its name first nor connect):

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
import stat
import struct
import tempfile
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


RUNTIME_FALLBACKS = 8
"""Numbered fallbacks of ``<tmp>/warmstart-<uid>`` tried when it is not this user's own."""
_MAX_SOCKET_PATH = 100
"""A Unix socket path is at most 107 bytes; a directory that makes it longer is skipped."""


def _private_dir(path: str) -> str | None:
    """Why ``path`` cannot hold this user's sockets (None: it can): created 0700 when
    missing; an existing one must be a directory (not a link) of this user that no one
    else may enter. The same rules as the memory tier's directory."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot create it ({exc.strerror})"
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot stat it ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory (a link or a file)"
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}"
    if st.st_mode & 0o077:
        return f"others may use it (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def runtime_dir() -> tuple[str | None, list[str]]:
    """This user's private directory for zygote sockets, and why each candidate before it
    was passed over: ``$XDG_RUNTIME_DIR/warmstart`` (when set), else
    ``<tmp>/warmstart-<uid>`` then ``-1`` .. ``-8`` (``<tmp>``: ``tempfile.gettempdir()``).
    A launcher and its zygote walk the same list, so they agree. None: no candidate is
    this user's (the launcher then runs cold)."""
    uid = os.geteuid()
    base = os.path.join(tempfile.gettempdir(), f"warmstart-{uid}")
    candidates = [base] + [f"{base}-{i}" for i in range(1, RUNTIME_FALLBACKS + 1)]
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        candidates.insert(0, os.path.join(xdg, "warmstart"))
    passed: list[str] = []
    for path in candidates:
        if len(path) + 30 > _MAX_SOCKET_PATH:
            passed.append(f"{path}: too long a path for a socket")
            continue
        why = _private_dir(path)
        if why is None:
            return path, passed
        passed.append(f"{path}: {why}")
    return None, passed


def socket_names(agent_pid: int, run_id: str, directory: str) -> tuple[str, str]:
    """``(lock, serve)``: the lock file and the socket path of the zygote of one torchrun
    agent, in this user's private ``directory`` (:func:`runtime_dir`).

    The zygote holds ``flock`` on ``lock`` from its start (only one per agent gets it; the
    kernel lets go when it dies) and binds ``serve`` once its imports are done, so a
    launcher that can connect to ``serve`` never waits for an import. The directory is
    private: no other user can bind the name first, or see it.
    """
    key = hashlib.sha256(f"{os.getuid()}:{agent_pid}:{run_id}".encode()).hexdigest()[:24]
    return os.path.join(directory, f"{key}.lock"), os.path.join(directory, f"{key}.sock")


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
