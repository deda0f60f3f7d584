"""elastic.init_distributed: the one process-group setup of the trainer and user scripts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _run(code: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env.update(extra_env)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env=env,
    )


@pytest.mark.timeout(90)
def test_without_torchrun_a_one_rank_gloo_group_on_the_cpu() -> None:
    code = (
        "import json, elastic, torch.distributed as dist\n"
        "ctx = elastic.init_distributed(timeout_s=30)\n"
        "again = elastic.init_distributed()  # an existing group is kept\n"
        "out = [ctx.rank, ctx.world_size, ctx.backend, str(ctx.device), ctx.is_main,\n"
        "       dist.get_backend(), again.world_size, ctx.run_id, ctx.attempt]\n"
        "elastic.close_distributed()\n"
        "out.append(dist.is_initialized())\n"
        "print(json.dumps(out))\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [0, 1, "gloo", "cpu", True, "gloo", 1, "local", 0, False]
    # The run context carries torchrun's run id and the job-wide restart count.
    result = _run(code, TORCHELASTIC_RUN_ID="job7", TORCHELASTIC_RESTART_COUNT="2")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)[7:9] == ["job7", 2]


@pytest.mark.timeout(90)
def test_a_world_without_a_rendezvous_address_is_refused_naming_the_variables() -> None:
    result = _run("import elastic; elastic.init_distributed()", WORLD_SIZE="2")
    assert result.returncode != 0
    assert "WORLD_SIZE=2 but MASTER_ADDR is not set" in result.stderr
    result = _run("import elastic; elastic.init_distributed(timeout_s=0)")
    assert "timeout_s must be > 0" in result.stderr


class _Saver:
    """A duck-typed saver that records what the guard asked of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def expected_save_s(self) -> float:
        return 1.0

    def emergency_save(self, step: int) -> bool:
        self.calls.append(f"emergency_save {step}")
        return True

    def inject_storage_fault(self, spec: str) -> None:
        self.calls.append(f"fault {spec}")

    def close(self) -> None:
        # Still guarded while the saver drains: the preemption handler is installed.
        self.calls.append(f"close guarded={guard_ref[0].preemption is not None}")


guard_ref: list = [None]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("raises", [False, True])
def test_the_guard_closes_its_saver_first_so_the_with_order_does_not_matter(raises: bool) -> None:
    import elastic

    saver = _Saver()
    guard = elastic.RunGuard(saver=saver, watchdog_s=0, peer_timeout_s=0, attempt=0, rank=0, env={})
    guard_ref[0] = guard
    with pytest.raises(RuntimeError) if raises else contextlib.nullcontext(), guard:
        if raises:
            raise RuntimeError("boom")
    assert saver.calls == ["close guarded=True"]
    assert guard.preemption is None  # torn down after the close


_COUNT_INET = (
    "def inet_fds():\n"
    "    n = 0\n"
    "    for name in os.listdir('/proc/self/fd'):\n"
    "        fd = int(name)\n"
    "        try:\n"
    "            if not stat.S_ISSOCK(os.fstat(fd).st_mode):\n"
    "                continue\n"
    "            with socket.socket(fileno=os.dup(fd)) as s:\n"
    "                n += s.family in (socket.AF_INET, socket.AF_INET6)\n"
    "        except OSError:\n"
    "            pass\n"
    "    return n\n"
)


@pytest.mark.timeout(90)
def test_forked_children_let_go_of_the_groups_tcp_sockets_and_the_group_still_works() -> None:
    # A killed rank's DataLoader workers (forked after the group exists) kept its gloo
    # connections open until they noticed their parent was gone (~5 s), so the peers
    # waited that long in their collective. A child forked after init_distributed holds
    # none of the parent's TCP sockets; the parent's group is untouched.
    code = (
        "import json, os, socket, stat, torch, elastic, torch.distributed as dist\n"
        + _COUNT_INET
        + "elastic.init_distributed(timeout_s=30)\n"
        "before = inet_fds()\n"
        "r, w = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.write(w, str(inet_fds()).encode()); os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "child = int(os.read(r, 64))\n"
        "t = torch.ones(3); dist.all_reduce(t)\n"
        "out = [before, child, inet_fds(), t.tolist()]\n"
        "elastic.close_distributed()\n"
        "print(json.dumps(out))\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    before, child, after, reduced = json.loads(result.stdout)
    assert before > 0  # the group's store and gloo sockets: the check can see them
    assert child == 0
    assert after == before and reduced == [1.0, 1.0, 1.0]


@pytest.mark.timeout(60)
def test_release_inherited_sockets_keeps_unix_sockets_and_the_descriptor_numbers() -> None:
    code = (
        "import json, os, socket, stat\n"
        "from elastic.distributed import release_inherited_sockets\n"
        + _COUNT_INET
        + "srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen()\n"
        "a, b = socket.socketpair()\n"
        "n = release_inherited_sockets()\n"
        "a.send(b'x')\n"
        "out = [n, inet_fds(), b.recv(1).decode(), stat.S_ISCHR(os.fstat(srv.fileno()).st_mode)]\n"
        "print(json.dumps(out))\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    # The TCP listener became /dev/null (a character device) under the same number; the
    # Unix socket pair still works.
    assert json.loads(result.stdout) == [1, 0, "x", True]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(30)
def test_wait_for_store_returns_once_the_port_listens_and_gives_up_at_its_bound() -> None:
    from elastic.distributed import _wait_for_store

    port = _free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(0.4)
        server.bind(("127.0.0.1", port))
        server.listen()

    thread = threading.Thread(target=listen_later)
    thread.start()
    try:
        waited = _wait_for_store("127.0.0.1", port, 20.0)
    finally:
        thread.join()
        server.close()
    assert 0.3 <= waited < 15.0  # it waited for the listener, not for its bound
    # Nobody listens: it returns at its bound (init_process_group then reports the failure).
    waited = _wait_for_store("127.0.0.1", _free_port(), 0.3)
    assert 0.3 <= waited < 10.0


@pytest.mark.timeout(120)
def test_a_rank_that_starts_before_rank_0_waits_for_its_store_and_the_group_works(
    tmp_path: Path,
) -> None:
    # Two ranks forked at once (a warm restart): rank 1 used to try rank 0's store before
    # it listened, had the connection refused and sat in PyTorch's backoff (0.3-0.6 s).
    # Now it polls the port; here rank 0 starts 0.5 s late and both build the group.
    port = _free_port()
    code = (
        "import json, logging, os, sys, time, torch, elastic, torch.distributed as dist\n"
        "logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)\n"
        "if os.environ['RANK'] == '0': time.sleep(0.5)\n"
        "ctx = elastic.init_distributed(timeout_s=30)\n"
        "t = torch.ones(2) * (ctx.rank + 1); dist.all_reduce(t)\n"
        "elastic.close_distributed()\n"
        "print(json.dumps([ctx.rank, ctx.world_size, t.tolist()]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in (0, 1)
    ]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err
            outs.append((json.loads(out), err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [o for o, _ in outs] == [[0, 2, [3.0, 3.0]], [1, 2, [3.0, 3.0]]]
    waited = re.search(r"store 127\.0\.0\.1:\d+ reachable after ([\d.]+) s", outs[1][1])
    assert waited is not None, outs[1][1]
    assert float(waited.group(1)) > 0.05  # rank 1 polled until rank 0 listened
    assert "reachable after" not in outs[0][1]  # rank 0 hosts the store: no wait
