"""Run a :class:`~warmstart.protocol.Target` in this interpreter, as ``python -m``/``python
path`` would (``sys.argv``, ``sys.path[0]``, ``__main__``)."""

from __future__ import annotations

import os
import runpy
import sys

from warmstart.protocol import Target


def run_target(target: Target) -> None:
    """Run the target's ``__main__`` code; its ``SystemExit`` (or exception) propagates."""
    if target.module is not None:
        sys.argv = [target.module, *target.args]  # runpy sets argv[0] to the module's file
        _set_path0(os.getcwd())
        runpy.run_module(target.module, run_name="__main__", alter_sys=True)
    else:
        assert target.path is not None
        path = os.path.abspath(target.path)
        if not os.path.exists(path):
            raise SystemExit(f"warmstart: can't open file {target.path!r}: no such file")
        sys.argv = [target.path, *target.args]
        _set_path0(os.path.dirname(path))
        runpy.run_path(path, run_name="__main__")


def _set_path0(entry: str) -> None:
    # Launcher and zygote both start as `python -m warmstart...`, which put their starting
    # directory first on sys.path; the target's own rule replaces it.
    if sys.path:
        sys.path[0] = entry
    else:
        sys.path.append(entry)
