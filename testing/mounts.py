"""Small tmpfs mounts for tests of full and read-only checkpoint roots.

As root, file permissions do not stop a write, so an unwritable root is made the
way it happens on a real machine: a read-only mount. A full disk is a tmpfs of a
few MB; a mount that goes away under a job is :func:`lazy_unmount`. Needs root
(CAP_SYS_ADMIN) and ``mount``/``umount``;
:func:`mount_problem` says why they cannot be used (a skip reason), or None. Every
mount made here is unmounted when its ``with`` block ends.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator

_PERMISSION_MARKERS = ("permission denied", "must be superuser", "operation not permitted")


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def mount_problem() -> str | None:
    """Why tmpfs mounts cannot be made here (not root, a sandbox), or None.

    Only a permission error counts; any other failure raises, so a broken setup is
    an error rather than a silent skip.
    """
    with tempfile.TemporaryDirectory(prefix="mount-probe-") as where:
        try:
            done = _run("mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", where)
        except FileNotFoundError:
            return "`mount` is not installed"
        if done.returncode != 0:
            err = (done.stderr or done.stdout).strip()
            if any(marker in err.lower() for marker in _PERMISSION_MARKERS):
                return f"`mount -t tmpfs` is not permitted here ({err}); it needs root"
            raise RuntimeError(f"mount -t tmpfs failed: {err}")
        _unmount(where)
    return None


@contextlib.contextmanager
def tmpfs(where: str, *, size: str = "6m") -> Iterator[str]:
    """Mount a fresh tmpfs of ``size`` at ``where`` (created if missing) for the block."""
    os.makedirs(where, exist_ok=True)
    done = _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where)
    if done.returncode != 0:
        raise RuntimeError(f"mount tmpfs at {where}: {(done.stderr or done.stdout).strip()}")
    try:
        yield where
    finally:
        if os.path.ismount(where):  # not detached already by the test (lazy_unmount)
            _unmount(where)


def lazy_unmount(where: str) -> None:
    """``umount -l``: detach the filesystem at ``where`` now, as a dropped mount does; the
    path then shows the mount point's underlying directory."""
    done = _run("umount", "-l", where)
    if done.returncode != 0:
        raise RuntimeError(f"umount -l {where}: {(done.stderr or done.stdout).strip()}")


def make_read_only(where: str) -> None:
    """Remount the tmpfs at ``where`` read-only (what is in it stays readable)."""
    done = _run("mount", "-o", "remount,ro", where)
    if done.returncode != 0:
        raise RuntimeError(f"remount {where} read-only: {(done.stderr or done.stdout).strip()}")


def _unmount(where: str) -> None:
    done = _run("umount", where)
    if done.returncode != 0:  # still busy (a process of the test holds a file): detach it
        done = _run("umount", "-l", where)
    if done.returncode != 0:
        raise RuntimeError(f"umount {where}: {(done.stderr or done.stdout).strip()}")
