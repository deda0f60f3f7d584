"""Leaving a worker process once its work is durable."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def exit_now(code: int) -> None:
    """Exit with ``code`` without interpreter teardown, once logs are flushed.

    Call it last, after checkpoints are committed (``CheckpointManager.close``) and the
    process group is destroyed. Teardown of native threads left by torch's collectives
    can abort a finished rank ("terminate called without an active exception", also in
    a plain FSDP2 + gloo script with neither ``ckpt`` nor ``elastic``), which makes
    torchrun report a finished job as failed.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def leave_from_monitor(code: int) -> None:
    """Exit with ``code`` now, from a monitor thread (watchdog, peer failure detector).

    Best effort only: every logging handler and the standard streams are flushed, each
    failure ignored; no ``logging.shutdown`` (it would close handlers the stuck main
    thread may still hold), no interpreter teardown.
    """
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def call_bounded(
    callback: Callable[[Any], None], arg: Any, *, name: str, limit_s: float, what: str
) -> None:
    """Run ``callback(arg)`` in a daemon thread of its own and wait ``limit_s`` at most: a
    monitor about to leave the process gives the user's hook a bounded chance to run (a
    hook that hangs or raises does not stop the exit; an exception is logged as ``what``)."""

    def run() -> None:
        try:
            callback(arg)
        except Exception:
            logger.exception("%s failed", what)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(limit_s)
