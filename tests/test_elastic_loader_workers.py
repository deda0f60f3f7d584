"""``elastic.loader_workers``: DataLoader workers outlive a SIGTERM meant for their parent.

Each test runs a small script in a process of its own session (so a process-group signal
reaches only it and its loader workers): a ``PreemptionHandler`` like the guard's, a
``DataLoader`` with two workers (``fork`` or ``spawn``), batches taken before and after the
signal. Without the shield the workers die of the group's SIGTERM and the parent's next
batch raises "DataLoader worker (pid N) is killed by signal: Terminated".
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from testing.local_cluster import REPO

SCRIPT = r"""
import json, os, sys, time
from torch.utils.data import DataLoader, Dataset
from elastic.loader_workers import shield_loader_workers
from elastic.preemption import PreemptionHandler


class Slow(Dataset):
    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        time.sleep(0.002)
        return i


def say(**fields):
    print(json.dumps(fields), flush=True)


def no_torch_parent_check(worker_id):
    # torch's worker notices a dead parent on its own within 5 s; push that out of reach so
    # the "wait" mode measures only the shield's own following of the parent
    from torch.utils.data._utils import worker
    worker.MP_STATUS_CHECK_INTERVAL = 600.0


if __name__ == "__main__":
    method, shield, mode = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
    if shield:
        shield_loader_workers()
    handler = PreemptionHandler(grace_s=30)
    init = no_torch_parent_check if mode == "wait" else None
    loader = DataLoader(
        Slow(), batch_size=4, num_workers=2, multiprocessing_context=method, worker_init_fn=init
    )
    say(starting=True)  # mode "early": the signal comes while the workers start
    batches = iter(loader)
    first = next(batches)
    workers = [w.pid for w in batches._workers]
    say(workers=workers)
    if mode == "terminate":  # the DataLoader's own terminate() of a worker still ends it
        w = batches._workers[0]
        t0 = time.monotonic()
        w.terminate()
        w.join(5)
        say(exitcode=w.exitcode, took_s=time.monotonic() - t0)
        sys.exit(0)
    if mode == "wait":  # the test signals the workers, then kills this process
        time.sleep(60)
    deadline = time.monotonic() + 30
    while not handler.requested and time.monotonic() < deadline:
        next(batches)
    served = [int(next(batches)[0]) for _ in range(5)]  # still served after the signal
    say(requested=handler.requested, served=served)
    sys.exit(143)
"""


def start(tmp_path, method: str, shield: bool, mode: str = "group") -> subprocess.Popen:
    path = tmp_path / "loader_script.py"
    path.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, str(path), method, "1" if shield else "0", mode],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
        start_new_session=True,
    )  # fmt: skip


def read_until(proc: subprocess.Popen, key: str) -> dict:
    for line in proc.stdout:
        if line.startswith("{"):
            fields = json.loads(line)
            if key in fields:
                return fields
    raise AssertionError(f"the script ended (rc {proc.wait()}) before it said {key!r}")


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode, out


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.02)
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_loader_workers_outlive_a_sigterm_to_the_process_group(tmp_path, method):
    proc = start(tmp_path, method, shield=True)
    workers = read_until(proc, "workers")["workers"]
    os.killpg(proc.pid, signal.SIGTERM)  # the parent and its loader workers, as torchrun does
    result = read_until(proc, "served")
    code, out = finish(proc)
    assert result["requested"] and len(result["served"]) == 5, out
    assert code == 143 and "killed by signal" not in out, out
    assert gone_within(workers, 10), "loader workers left behind"


@pytest.mark.timeout(120)
def test_without_the_shield_the_group_sigterm_kills_the_loader_workers(tmp_path):
    """What the shield is for (torch's own behaviour, checked so the test above can fail)."""
    proc = start(tmp_path, "fork", shield=False)
    read_until(proc, "workers")
    os.killpg(proc.pid, signal.SIGTERM)
    code, out = finish(proc)
    assert code != 143 and "killed by signal: Terminated" in out, out


@pytest.mark.timeout(120)
def test_spawn_workers_are_shielded_while_they_start(tmp_path):
    """A spawn worker imports for a second or more before its loop runs; the parent starts it
    with SIGTERM blocked, so a group SIGTERM in that window does not kill it either."""
    proc = start(tmp_path, "spawn", shield=True, mode="early")
    read_until(proc, "starting")
    stop = threading.Event()

    def signal_the_group() -> None:  # again and again while the workers start
        while not stop.wait(0.02):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)

    thread = threading.Thread(target=signal_the_group, daemon=True)
    thread.start()
    try:
        read_until(proc, "workers")
    finally:
        stop.set()
        thread.join()
    result = read_until(proc, "served")
    code, out = finish(proc)
    assert code == 143 and len(result["served"]) == 5 and "killed by signal" not in out, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_loaders_own_terminate_still_ends_a_worker(tmp_path, method):
    proc = start(tmp_path, method, shield=True, mode="terminate")
    result = read_until(proc, "exitcode")
    code, out = finish(proc)
    assert code == 0, out
    assert result["exitcode"] == 0 and result["took_s"] < 2.0, result  # torch's: exit 0 at once


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_after_a_foreign_sigterm_workers_leave_with_their_parent(tmp_path, method):
    """A SIGTERM from elsewhere leaves a worker running while its parent runs; once the
    parent is gone (here SIGKILLed, as torchrun does after the grace period) it leaves
    by the shield's own check of its parent (every FOLLOW_POLL_S): torch's own check is
    pushed to 600 s in this mode, so a bound well above 0.05 s still proves it and a
    loaded machine's scheduling cannot fail it."""
    proc = start(tmp_path, method, shield=True, mode="wait")
    workers = read_until(proc, "workers")["workers"]
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)
    assert all(_alive(p) for p in workers)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    try:
        assert gone_within(workers, 20.0), "loader workers outlived their parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of its group
        proc.stdout.close()
