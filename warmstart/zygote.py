"""``python -m warmstart.zygote AGENT_PID RUN_ID [--watch MOD[,MOD...]] [MODULE ...]``: one
per torchrun agent.

Imports the modules (torch and what a training worker always needs) and the watched ones
(this project's library, the user's ``--preload``), then forks one child per launcher
request. Before each fork it compares the source files of the watched modules it
imported with what they were then: one changed (an edit or an upgrade between two
attempts), it refuses the request (the launcher runs cold and starts a fresh zygote),
lets go of its socket names, and exits once its children are gone, so no worker runs
stale code of those modules. Single-threaded on purpose: a fork copies only the calling
thread, so nothing else may run here. Every 0.1 s it also

- reaps exited children and sends each launcher its child's ``waitpid`` status;
- SIGKILLs the child of a launcher that went away (killed: its connection closed);
- stops the child of a stopped launcher (SIGSTOP, a frozen node) and continues it with
  the launcher;
- exits once its agent is gone and no child is left.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import importlib
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from warmstart.protocol import (
    Target,
    peer_pid_uid,
    recv_frame,
    runtime_dir,
    send_frame,
    socket_names,
)
from warmstart.target import run_target

TICK_S = 0.1
REQUEST_TIMEOUT_S = 5.0


@dataclass(slots=True)
class Request:
    """What a forked child runs, as the launcher asked for it."""

    target: Target
    env: dict[str, str]
    cwd: str
    fds: list[int]


@dataclass(slots=True)
class Launcher:
    sock: socket.socket
    pid: int
    child: int = 0
    stopped: bool = False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _state(pid) not in ("Z", "X", "")


def _state(pid: int) -> str:
    """The one-letter state of ``pid`` from ``/proc`` ("" when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


Sources = dict[str, tuple[int, int]]
"""Source file -> (mtime_ns, size) of the watched modules, as imported."""


def watched_sources(packages: list[str]) -> Sources:
    """The source files of every imported module of ``packages`` (top-level names)."""
    tops = {name.split(".")[0] for name in packages}
    out: Sources = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.split(".")[0] in tops and path:
            try:
                st = os.stat(path)
            except OSError:
                continue
            out[path] = (st.st_mtime_ns, st.st_size)
    return out


def changed_source(sources: Sources) -> str | None:
    """The first of ``sources`` that changed or went away since it was imported, or None."""
    for path, (mtime_ns, size) in sources.items():
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_mtime_ns, st.st_size) != (mtime_ns, size):
            return path
    return None


def serve(
    listener: socket.socket,
    agent_pid: int,
    sources: Sources | None = None,
    release: Callable[[], None] = lambda: None,
) -> Request | None:
    """The zygote's loop. Returns only in a freshly forked child (its request), or None
    when the zygote should exit. ``sources``: checked before each fork; once one changed,
    ``release()`` (the socket names go), every request is refused with ``{"stale"}`` and
    the loop ends when no child is left."""
    launchers: dict[socket.socket, Launcher] = {}
    by_child: dict[int, Launcher] = {}
    stale: str | None = None
    while True:
        watch = [listener, *launchers] if stale is None else list(launchers)
        ready, _, _ = select.select(watch, [], [], TICK_S)
        for sock in ready:
            if sock is listener:
                _accept(listener, launchers)
                continue
            launcher = launchers.get(sock)
            if launcher is None:
                continue
            if launcher.child == 0:
                request = _read_request(launcher, launchers)
                if request is None:
                    continue
                if stale is None and sources:
                    stale = changed_source(sources)
                    if stale is not None:
                        release()
                        listener.close()
                if stale is not None:
                    _refuse(launcher, launchers, request, stale)
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in launchers:
                        other.close()
                    return request
                for fd in request.fds:
                    os.close(fd)
                launcher.child = pid
                by_child[pid] = launcher
                try:
                    send_frame(sock, {"pid": pid})
                except OSError:
                    pass  # the launcher is gone: the EOF below kills the child
            else:
                # A launcher sends nothing after its request: readable means it closed.
                try:
                    gone = not sock.recv(1)
                except OSError:
                    gone = True
                if gone:
                    _signal(launcher.child, signal.SIGKILL)
                    if launcher.stopped:
                        _signal(launcher.child, signal.SIGCONT)
                    del launchers[sock]
                    sock.close()
        _reap(by_child, launchers)
        _mirror_stops(by_child)
        if not by_child and (stale is not None or not _alive(agent_pid)):
            return None


def _refuse(
    launcher: Launcher, launchers: dict[socket.socket, Launcher], request: Request, path: str
) -> None:
    for fd in request.fds:
        os.close(fd)
    _last_word(launcher, launchers, {"stale": path})


def _last_word(launcher: Launcher, launchers: dict[socket.socket, Launcher], payload: dict) -> None:
    """Send ``launcher`` its final frame (it may be gone) and forget it."""
    try:
        send_frame(launcher.sock, payload)
    except OSError:
        pass
    del launchers[launcher.sock]
    launcher.sock.close()


def _accept(listener: socket.socket, launchers: dict[socket.socket, Launcher]) -> None:
    try:
        sock, _ = listener.accept()
    except OSError:
        return
    pid, uid = peer_pid_uid(sock)
    if uid != os.getuid():
        sock.close()  # someone else's process: this zygote serves its own user only
        return
    launchers[sock] = Launcher(sock=sock, pid=pid)


def _read_request(launcher: Launcher, launchers: dict[socket.socket, Launcher]) -> Request | None:
    sock = launcher.sock
    sock.settimeout(REQUEST_TIMEOUT_S)
    try:
        raw, fds = recv_frame(sock, with_fds=True)
        request = Request(
            target=Target.from_json(raw["target"]),
            env={str(k): str(v) for k, v in raw["env"].items()},
            cwd=str(raw["cwd"]),
            fds=fds,
        )
    except (OSError, EOFError, ValueError, KeyError, TypeError):
        del launchers[sock]
        sock.close()
        return None
    finally:
        if sock.fileno() >= 0:
            sock.settimeout(None)
    if len(request.fds) != 3:
        for fd in request.fds:
            os.close(fd)
        del launchers[sock]
        sock.close()
        return None
    return request


def _reap(by_child: dict[int, Launcher], launchers: dict[socket.socket, Launcher]) -> None:
    while by_child:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        launcher = by_child.pop(pid, None)
        if launcher is None or launcher.sock not in launchers:
            continue
        _last_word(launcher, launchers, {"status": status})


def _mirror_stops(by_child: dict[int, Launcher]) -> None:
    for child, launcher in by_child.items():
        stopped = _state(launcher.pid) in ("T", "t")
        if stopped and not launcher.stopped:
            _signal(child, signal.SIGSTOP)
            launcher.stopped = True
        elif launcher.stopped and not stopped:
            _signal(child, signal.SIGCONT)
            launcher.stopped = False


def become_child(request: Request) -> None:
    """Turn a freshly forked zygote into the launcher's worker (same stdio, env, cwd)."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()  # like torchrun's workers: a session of its own
    for target_fd, fd in zip((0, 1, 2), request.fds, strict=True):
        os.dup2(fd, target_fd)
    for fd in request.fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)


def _locked(path: str) -> int | None:
    """An fd of ``path`` holding its ``flock``; None if a live process holds it, or it is
    not a plain file of ours. The lock must still be the file at ``path`` once taken: a
    sweep (:func:`sweep_stale`) may have removed the name between our open and our lock."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held, now = os.fstat(fd), os.lstat(path)
        if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _take_lock(path: str) -> int | None:
    for _ in range(3):  # a sweep removing the name as we open it: open the new one
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        os.close(fd)
        fd = _locked(path)
        if fd is not None:
            return fd
        if os.path.lexists(path):
            return None  # held: another zygote serves this agent
    return None


def sweep_stale(directory: str, keep: tuple[str, ...] = ()) -> list[str]:
    """Remove the lock and socket files of zygotes that died without cleaning up
    (SIGKILLed, OOM-killed, a node's reboot of a persistent runtime dir): a lock no live
    process holds, and a socket without its lock. What another live zygote holds stays.
    Only names this module makes (24 hex digits, ``.lock`` or ``.sock``) are touched.
    Returns the paths removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    stems = {n[:-5] for n in names if _is_ours(n)}
    for stem in sorted(stems):
        lock, sock = (os.path.join(directory, stem + ext) for ext in (".lock", ".sock"))
        if lock in keep or sock in keep:
            continue
        fd = _locked(lock) if os.path.lexists(lock) else None
        if fd is None and os.path.lexists(lock):
            continue  # a live zygote's
        try:
            for path in (sock, lock):  # the socket first: a lock without one is never served
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed.append(path)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def _is_ours(name: str) -> bool:
    stem, _, ext = name.rpartition(".")
    return (
        ext in ("lock", "sock") and len(stem) == 24 and all(c in "0123456789abcdef" for c in stem)
    )


def main(argv: list[str]) -> int:
    agent_pid, run_id, modules = int(argv[0]), argv[1], argv[2:]
    watched: list[str] = []
    if modules[:1] == ["--watch"] and len(modules) > 1:
        watched = [m for m in modules[1].split(",") if m]
        modules = modules[2:]
    directory, _passed = runtime_dir()  # the launcher said why, if it had to pass any
    if directory is None:
        return 0
    lock_path, serve_path = socket_names(agent_pid, run_id, directory)
    lock = _take_lock(lock_path)
    if lock is None:
        return 0  # another zygote serves (or is getting ready to serve) this agent
    held = [lock]
    sweep_stale(directory, keep=(lock_path, serve_path))

    def release(remove_lock: bool = False) -> None:
        """The names go (stale code, or the agent gone): a fresh zygote may take them."""
        if held:
            with contextlib.suppress(OSError):
                os.unlink(serve_path)
            if remove_lock:
                with contextlib.suppress(OSError):
                    os.unlink(lock_path)
            os.close(held.pop())

    started = time.monotonic()
    for name in [*modules, *watched]:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a zygote without it is still useful
            print(f"warmstart zygote: import {name} failed: {exc}", file=sys.stderr)
    sources = watched_sources(watched)
    # Every object imported so far goes to the collector's permanent generation, which
    # forked children inherit: their full collections no longer walk (and copy on write)
    # torch's ~300k module objects, a fraction of a second each; the first one would
    # otherwise land in a warm worker's checkpoint load and take longer than a small
    # resume itself.
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(serve_path)  # a dead zygote's: the lock says none serves
    listener.bind(serve_path)
    listener.listen(64)
    print(
        f"warmstart zygote: ready for agent {agent_pid} after {time.monotonic() - started:.1f} s"
        f" ({len(sources)} watched source files)",
        file=sys.stderr,
    )
    request = serve(listener, agent_pid, sources, release=release)
    if request is None:
        release(remove_lock=True)  # the agent is gone: no zygote will want them
        return 0
    if held:
        os.close(held.pop())  # the child's copy; the zygote keeps the lock
    become_child(request)
    run_target(request.target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
