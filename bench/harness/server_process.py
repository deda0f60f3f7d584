"""A local server process for tests and benchmarks: started on a free loopback port,
waited for, and stopped, crashed or frozen on purpose.

Shared by the storage emulators (``gcs_emulator``: fake-gcs-server; ``s3_server``: moto).
The server's output goes to a log file (never an unread pipe, which a chatty server
could fill and block on); :meth:`ServerProcess.log_tail` shows it in error messages.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

from bench.harness.ports import free_port

NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""The servers are local; a proxy from the environment must never see these requests."""
STOP_TIMEOUT_S = 5.0
START_ATTEMPTS = 3
"""A free port is chosen before the server binds it; another process may take it between."""


class ServerStartError(RuntimeError):
    """The server did not come up in time (or exited)."""


class ServerProcess:
    """One running server process that this process (a test session, the bench) started.

    ``stop`` ends it for good; ``kill``, ``pause`` and ``resume`` are fault injection: a
    crashed server (connection refused) and a hung one (connections accepted, never
    answered).
    """

    def __init__(
        self, process: subprocess.Popen[bytes], port: int, log_path: str, log_dir: str
    ) -> None:
        self.process = process
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log_dir = log_dir
        self._paused = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, max_chars: int = 2000) -> str:
        """Last characters of the server's own output, for error messages."""
        try:
            with open(self.log_path, "rb") as log:
                data = log.read()
        except OSError:
            return ""
        return data[-max_chars:].decode(errors="replace")

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): the kernel still accepts connections, nothing answers."""
        if self.is_running():
            os.kill(self.process.pid, signal.SIGSTOP)
            self._paused = True
            # SIGSTOP is asynchronous: wait (bounded) until the kernel reports it stopped,
            # or a request sent right after pause() may still be answered.
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and _proc_state(self.process.pid) not in ("T", "t"):
                time.sleep(0.01)

    def resume(self) -> None:
        """Undo ``pause``."""
        if self._paused and self.is_running():
            os.kill(self.process.pid, signal.SIGCONT)
        self._paused = False

    def kill(self) -> None:
        """Crash the server (SIGKILL) and reap it; its in-memory objects are gone."""
        if self.is_running():
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=STOP_TIMEOUT_S)
        self._paused = False

    def stop(self) -> None:
        """Terminate the process we started (SIGTERM, then SIGKILL) with bounded waits."""
        if self.is_running():
            self.resume()  # a stopped process would not act on SIGTERM
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self._log_dir, ignore_errors=True)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(endpoint={self.endpoint!r}, pid={self.process.pid})"


def start_server(
    argv_for: Callable[[int], list[str]],
    answers: Callable[[str], bool],
    *,
    name: str,
    port: int | None = None,
    ready_timeout_s: float = 20.0,
    env: dict[str, str] | None = None,
    server_class: type[ServerProcess] = ServerProcess,
) -> ServerProcess:
    """Start ``argv_for(port)`` and return once ``answers(endpoint)`` is true.

    ``port=None`` picks a free loopback port (and tries again with another one if the
    server does not come up, up to :data:`START_ATTEMPTS` times). Raises
    :class:`ServerStartError` with the server's output when it does not answer within
    ``ready_timeout_s`` or exits.
    """
    last_error = ""
    for _ in range(START_ATTEMPTS if port is None else 1):
        chosen = port if port is not None else free_port()
        endpoint = f"http://127.0.0.1:{chosen}"
        argv = argv_for(chosen)
        log_dir = tempfile.mkdtemp(prefix=f"{name}-")
        log_path = os.path.join(log_dir, "server.log")
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=None if env is None else {**os.environ, **env},
            )
        server = server_class(process, chosen, log_path, log_dir)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline and server.is_running():
            if answers(endpoint):
                return server
            time.sleep(0.05)
        running = server.is_running()
        last_error = (
            f"{name} ({argv[0]}) on {endpoint} "
            + (
                f"did not answer within {ready_timeout_s:.0f} s"
                if running
                else f"exited with code {process.returncode}"
            )
            + f"; its output: {server.log_tail()!r}"
        )
        server.stop()
    raise ServerStartError(last_error)


def answers_ok(url: str) -> bool:
    """Whether ``GET url`` is answered with 200 within a second."""
    try:
        with NO_PROXY_OPENER.open(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def environ_for(server: ServerProcess, env: dict[str, str]) -> Iterator[ServerProcess]:
    """``env`` in ``os.environ`` for the block (this process and the ones it starts); the
    previous values come back afterwards and the server is stopped, also on errors."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield server
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()


def _proc_state(pid: int) -> str:
    """One-letter state of ``pid`` from /proc (``T`` when stopped), or '' if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
