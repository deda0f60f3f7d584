"""``python -m warmstart [--cold] [--preload MOD[,MOD...]] (-m MODULE | SCRIPT) [ARGS...]``.

The worker process torchrun starts. Under torchrun it runs its target in a child forked
by this node's zygote when one is ready (a warm start: no imports to pay), else starts
a zygote for the next attempt and runs the target itself. See :mod:`warmstart`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from warmstart.protocol import (
    ENV_RUN_ID,
    STDIO_FDS,
    Target,
    peer_pid_uid,
    recv_frame,
    runtime_dir,
    send_frame,
    socket_names,
)
from warmstart.target import run_target

DEFAULT_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.elastic.multiprocessing.errors",
    "torch._dynamo",  # imported lazily by the first fully_shard: most of a second otherwise
    "numpy",
)
"""What the zygote imports before it serves, unwatched: third-party modules, taken not to
change while an agent lives."""

DEFAULT_WATCHED = ("ckpt", "elastic")
"""This project's library, imported by the zygote too (with fsspec, tenacity and the
rest of what it imports: time a warm worker does not pay) but *watched*: before each
fork the zygote compares their source files with what it imported, and after a change
(an edit, an upgrade) the worker starts cold and a fresh zygote takes over. Modules given
with ``--preload`` are watched the same way; the target (``-m trainer``, a script) is
imported fresh by every worker."""

ENV_PRELOAD = "WARMSTART_PRELOAD"
"""Comma-separated modules that replace :data:`DEFAULT_PRELOAD` and
:data:`DEFAULT_WATCHED` (empty: import nothing but ``--preload``)."""

ENV_LOG = "WARMSTART_LOG"
"""A file the zygote appends its own messages to (default: they are dropped)."""

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2)  # fmt: skip
"""Signals the launcher passes on to its forked child (torchrun stops workers with SIGTERM)."""

PID_TIMEOUT_S = 30.0

USAGE = (
    "usage: python -m warmstart [--cold] [--preload MOD[,MOD...]] (-m MODULE | SCRIPT) [ARGS...]"
)


class UsageError(Exception):
    pass


def parse(argv: list[str]) -> tuple[bool, list[str], Target]:
    """``(cold, extra preload modules, target)``; launcher options come before the target."""
    cold = False
    preload: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--cold":
            cold = True
        elif arg == "--preload" or arg.startswith("--preload="):
            if arg == "--preload":
                i += 1
                if i == len(argv):
                    raise UsageError("--preload needs a value: MOD[,MOD...]")
                value = argv[i]
            else:
                value = arg.split("=", 1)[1]
            preload += [m.strip() for m in value.split(",") if m.strip()]
        elif arg in ("-h", "--help"):
            raise UsageError(__doc__ or USAGE)
        elif arg == "-m":
            if i + 1 == len(argv):
                raise UsageError("-m needs a module name")
            return cold, preload, Target(module=argv[i + 1], path=None, args=argv[i + 2 :])
        elif arg.startswith("-"):
            raise UsageError(f"unknown option {arg!r}")
        else:
            return cold, preload, Target(module=None, path=arg, args=argv[i + 1 :])
        i += 1
    raise UsageError("no target: give -m MODULE or a script path")


def _say(message: str) -> None:
    print(f"warmstart[{os.environ.get('RANK', '?')}]: {message}", file=sys.stderr, flush=True)


def start_zygote(agent_pid: int, run_id: str, preload: list[str]) -> None:
    """Start this agent's zygote in the background (it exits at once if one exists)."""
    base = os.environ.get(ENV_PRELOAD)
    modules = list(DEFAULT_PRELOAD) if base is None else [m for m in base.split(",") if m]
    watched = [*DEFAULT_WATCHED, *preload] if base is None else list(preload)
    log = os.environ.get(ENV_LOG)
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (handed to Popen)
    try:
        cmd = [sys.executable, "-u", "-m", "warmstart.zygote", str(agent_pid), run_id]
        if watched:
            cmd += ["--watch", ",".join(watched)]
        subprocess.Popen(
            [*cmd, *modules],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,  # not in the launcher's group: torchrun's signals skip it
            close_fds=True,
        )
    finally:
        if log:
            out.close()  # type: ignore[union-attr]


class NotOurZygote(ConnectionError):
    """Whoever listens on the zygote's socket name runs as another user."""


def _connect(name: str) -> tuple[socket.socket, int] | None:
    """A connection to this node's zygote and its pid, or None when none listens. Raises
    :class:`NotOurZygote`, before a byte is sent, when the listener is another user's (the
    socket lives in this user's private directory, so only root could put one there; the
    request carries this process's environment, credentials included, and its stdio)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(name)
        pid, uid = peer_pid_uid(sock)
    except OSError:
        sock.close()
        return None
    if uid != os.geteuid():
        sock.close()
        raise NotOurZygote(
            f"the warm-start socket of this node is held by uid {uid} (pid {pid}), not by this "
            f"user (uid {os.geteuid()}): not trusted, nothing sent"
        )
    return sock, pid


def _parent_of(pid: int) -> int:
    """The parent pid of ``pid`` (``/proc``), or -1 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode("ascii", "replace")
        return int(stat.rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


class StaleZygote(ConnectionError):
    """The zygote refused to fork: a watched module's source changed since it imported it."""


def run_warm(sock: socket.socket, target: Target, zygote_pid: int = -1) -> int:
    """Have the zygote fork ``target``; forward signals; return the child's exit code
    (negative: killed by that signal). Raises ``ConnectionError`` when no child was forked
    (:class:`StaleZygote` when the zygote refused: its watched code changed)."""
    t0 = time.monotonic()
    pending: list[int] = []
    child = 0

    def forward(signum: int, _frame: object) -> None:
        if child:
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass
        else:
            pending.append(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    request = {"target": target.to_json(), "env": dict(os.environ), "cwd": os.getcwd()}
    try:
        sock.settimeout(PID_TIMEOUT_S)
        send_frame(sock, request, STDIO_FDS)
        reply, _ = recv_frame(sock)
    except (OSError, EOFError, ValueError) as exc:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        raise ConnectionError(f"the zygote did not fork a worker: {exc}") from exc
    if "stale" in reply:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in pending:  # arrived while it was asked: this process takes them
            os.kill(os.getpid(), signum)
        raise StaleZygote(f"{reply['stale']} changed since the warm interpreter imported it")
    child = int(reply["pid"])
    if zygote_pid > 0 and _parent_of(child) != zygote_pid:
        # Signals and the SIGKILL below go only to a process the zygote started.
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        raise ConnectionError(f"the zygote reported pid {child}, which is not its child")
    _say(f"warm start: worker pid {child}, forked in {1000 * (time.monotonic() - t0):.0f} ms")
    for signum in pending:
        os.kill(child, signum)
    sock.settimeout(None)
    try:
        reply, _ = recv_frame(sock)
    except (OSError, EOFError, ValueError) as exc:
        # The zygote died: the status is lost. Do not leave the worker behind.
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _say(f"lost the zygote while worker {child} ran ({exc}); exiting 1")
        return 1
    return os.waitstatus_to_exitcode(int(reply["status"]))


def _exit_like(code: int) -> None:
    """Exit as the child did: with its code, or killed by the same signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        sig = -code
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these two have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        time.sleep(1.0)  # a stop/ignored signal would land here
        os._exit(128 + sig)
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    try:
        cold, preload, target = parse(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"{exc}\n{USAGE}" if str(exc) != (__doc__ or USAGE) else exc, file=sys.stderr)
        return 2
    run_id = os.environ.get(ENV_RUN_ID)
    if cold or not run_id:
        run_target(target)
        return 0
    agent_pid = os.getppid()
    directory, passed = runtime_dir()
    for why in passed:
        _say(f"warm-start directory {why}: not used")
    if directory is None:
        _say("no private warm-start directory of this user (see above): running cold")
        run_target(target)
        return 0
    _lock, serve_name = socket_names(agent_pid, run_id, directory)
    try:
        found = _connect(serve_name)
    except NotOurZygote as exc:
        _say(f"{exc}; running cold")
        run_target(target)
        return 0
    if found is not None:
        sock, zygote_pid = found
        try:
            code = run_warm(sock, target, zygote_pid)
        except StaleZygote as exc:
            _say(f"{exc}: running cold, starting a fresh one for restarts")
            start_zygote(agent_pid, run_id, preload)
        except ConnectionError as exc:
            _say(f"{exc}; running cold")
        else:
            _exit_like(code)
        finally:
            sock.close()
    else:
        _say("no warm interpreter for this node yet: running cold, starting one for restarts")
        start_zygote(agent_pid, run_id, preload)
    run_target(target)
    return 0
