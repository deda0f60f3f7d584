"""A bounded subprocess run for end-to-end tests: kill the whole tree on timeout."""

from __future__ import annotations

import os
import signal
import subprocess

from testing.local_cluster import descendants


class RunTimeoutError(TimeoutError):
    """The command outlived its deadline; it and every descendant were SIGKILLed."""

    def __init__(self, cmd: list[str], timeout_s: float, output: str) -> None:
        super().__init__(f"{' '.join(cmd)} still running after {timeout_s} s:\n{output[-4000:]}")
        self.output = output


def run_bounded(
    cmd: list[str], *, env: dict[str, str], cwd: str, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (stdout and stderr together) with a deadline.

    torchrun starts workers in their own sessions, so on timeout every descendant of
    the process is killed by pid, not only its process group.
    """
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pid in [*descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, _ = proc.communicate()
        raise RunTimeoutError(cmd, timeout_s, out) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout=out)
