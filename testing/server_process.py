"""A local server process the tests start, freeze and kill: :mod:`bench.harness.server_process`
(shipped with ``bench``, whose gcs and s3 groups start servers from an installed wheel too)."""

from __future__ import annotations

from bench.harness.server_process import (
    NO_PROXY_OPENER,
    START_ATTEMPTS,
    STOP_TIMEOUT_S,
    ServerProcess,
    ServerStartError,
    answers_ok,
    environ_for,
    start_server,
)

__all__ = [
    "NO_PROXY_OPENER",
    "START_ATTEMPTS",
    "STOP_TIMEOUT_S",
    "ServerProcess",
    "ServerStartError",
    "answers_ok",
    "environ_for",
    "start_server",
]
