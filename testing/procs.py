"""A bounded subprocess run for end-to-end tests: kill the whole tree on timeout."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from testing.local_cluster import REPO, descendants

MICRO_BATCH = "data.micro_batch=4"
"""The ``--set`` of the e2e scenarios that train the tiny GPT (global batch 24): 1, 2 or 3
ranks accumulate 6, 3 or 2 micro-batches per step. Half the FSDP passes of the config's
micro-batch of 2, the same samples per step; accumulation still runs at every world size."""


STACKS_GRACE_S = 2.0
"""After a timeout, how long the processes get to print their stacks before SIGKILL."""


class RunTimeoutError(TimeoutError):
    """The command outlived its deadline; it and every descendant were SIGKILLed."""

    def __init__(self, cmd: list[str], timeout_s: float, output: str) -> None:
        super().__init__(f"{' '.join(cmd)} still running after {timeout_s} s:\n{output[-12000:]}")
        self.output = output


def run_bounded(
    cmd: list[str], *, env: dict[str, str], cwd: str, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (stdout and stderr together) with a deadline.

    torchrun starts workers in their own sessions, so on timeout every descendant of
    the process is killed by pid, not only its process group. Python's fault handler is
    on in each of them: on timeout they are sent SIGABRT first, so the output ends with
    every thread's stack of every process (where a hang hung), then SIGKILL.
    """
    proc = subprocess.Popen(
        cmd, cwd=cwd, env={**env, "PYTHONFAULTHANDLER": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        tree = [*descendants(proc.pid), proc.pid]
        for sig in (signal.SIGABRT, signal.SIGKILL):
            for pid in tree:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if sig == signal.SIGABRT:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=STACKS_GRACE_S)
                time.sleep(0.5)  # the workers' dumps, after the parent's
        out, _ = proc.communicate()
        raise RunTimeoutError(cmd, timeout_s, out) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout=out)


TORCHRUN_CLEAN_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TRAINER_FAULTS",
)  # fmt: skip
"""Variables of an outer distributed job that must not leak into a test's torchrun."""


def torchrun_command(
    args: list[str],
    *,
    nproc: int = 2,
    max_restarts: int = 0,
    program: tuple[str, ...] = ("-m", "trainer"),
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of ``torchrun --standalone --nproc_per_node=N -m trainer
    ARGS`` (``program``: what torchrun runs instead of ``-m trainer``, e.g. a script's path)."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_CLEAN_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", f"--max_restarts={max_restarts}", "--monitor_interval=0.5",
        *program, *args,
    ]  # fmt: skip
    return cmd, env


def torchrun_trainer(
    args: list[str],
    *,
    cwd: str,
    nproc: int = 2,
    max_restarts: int = 0,
    timeout_s: float = 90,
    program: tuple[str, ...] = ("-m", "trainer"),
    env_extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc_per_node=N -m trainer ARGS``, bounded (stdout+stderr).

    ``program``: what torchrun runs instead of ``-m trainer`` (e.g. a script's path);
    ``env_extra``: variables added to its environment.
    """
    cmd, env = torchrun_command(args, nproc=nproc, max_restarts=max_restarts, program=program)
    env.update(env_extra or {})
    return run_bounded(cmd, env=env, cwd=cwd, timeout_s=timeout_s)


def run_example(
    script: str,
    ckpt_dir: str,
    run_dir: str,
    *args: str,
    nproc: int,
    timeout_s: float,
    max_restarts: int = 0,
    must_pass: bool = True,
) -> subprocess.CompletedProcess[str]:
    """An example script (``--ckpt-dir``, ``--run-dir``, ``ARGS``) under ``torchrun
    --standalone``, bounded (:class:`RunTimeoutError`); ``must_pass``: an exit other than
    0 is an ``AssertionError`` showing the output's end."""
    result = torchrun_trainer(
        ["--ckpt-dir", ckpt_dir, "--run-dir", run_dir, *args], cwd=REPO, nproc=nproc,
        max_restarts=max_restarts, timeout_s=timeout_s, program=(script,),
    )  # fmt: skip
    if must_pass and result.returncode != 0:
        raise AssertionError(f"{script} exited {result.returncode}:\n{result.stdout[-6000:]}")
    return result


def step_rows(run_dir: str) -> dict[int, dict]:
    """``metrics.jsonl`` of a run directory by step; a step trained again after a restart
    keeps its last row."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return {row["step"]: row for row in map(json.loads, filter(str.strip, fh))}


def copy_root_until(src: str, dst: str, step: int) -> None:
    """Copy a checkpoint root to ``dst`` without its checkpoints after ``step`` (a root as
    the run left it at ``step``, to resume elsewhere)."""
    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        if name.startswith("checkpoint_") and int(name.split("_")[1]) > step:
            shutil.rmtree(os.path.join(dst, name))


def signal_tree(pid: int, signum: int) -> None:
    """Send ``signum`` to ``pid`` and every descendant (torchrun's workers have sessions of
    their own, so a process group does not reach them); gone ones are skipped."""
    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, signum)
        except ProcessLookupError:
            pass
