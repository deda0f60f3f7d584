"""Another local user cannot take what a job hands to its warm-start zygote.

The launcher (``python -m warmstart``) used to connect to an abstract Unix socket whose
name anyone on the host could see and bind first, and sent whoever listened the job's
whole environment (cloud credentials, tokens) and its stdio. Now the socket lives in this
user's private directory: a real second user is made for the test (``useradd``; root
only); it takes the directory's name first and listens in it, and the job passes over it,
trains, and runs warm from the next private directory; the squatter receives nothing. A
listener of another uid inside the job's own directory (only root could put it there) is
still refused before a byte is sent.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from warmstart.protocol import ENV_RUN_ID, socket_names

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(180)

SQUATTER = r"""
import socket, sys, time
import os
name, out = sys.argv[1], sys.argv[2]
os.makedirs(os.path.dirname(name), mode=0o777, exist_ok=True)
os.chmod(os.path.dirname(name), 0o777)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(name)
os.chmod(name, 0o777)
s.listen(4)
open(out, "w").write("listening\n")
s.settimeout(60)
got = b""
try:
    conn, _ = s.accept()
    conn.settimeout(5)
    try:
        while chunk := conn.recv(65536):
            got += chunk
    except OSError:
        pass
    open(out, "a").write(f"connected, {len(got)} bytes\n" + got[:4000].decode("latin-1"))
except OSError as exc:
    open(out, "a").write(f"no connection: {exc}\n")
"""


@pytest.fixture
def other_user():
    if os.geteuid() != 0 or not os.path.exists("/usr/sbin/useradd"):
        pytest.skip("making a second local user needs root and useradd")
    name = f"wsq{secrets.token_hex(3)}"
    subprocess.run(["/usr/sbin/useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["/usr/sbin/userdel", name], check=False)


AGENT = r"""
import os, subprocess, sys, time
from warmstart.protocol import runtime_dir, socket_names
run_id, target, out = sys.argv[1], sys.argv[2], sys.argv[3]
for attempt in range(2):
    if attempt:  # the zygote serves once its imports are done
        _, serve = socket_names(os.getpid(), run_id, runtime_dir()[0])
        deadline = time.monotonic() + 60
        while not os.path.exists(serve) and time.monotonic() < deadline:
            time.sleep(0.1)
    with open(f"{out}.{attempt}", "w") as err:
        rc = subprocess.call([sys.executable, "-m", "warmstart", target], stderr=err)
    assert rc == 0, rc
"""


def _squat(user: str, path: str, report: pathlib.Path) -> subprocess.Popen:
    squatter = subprocess.Popen(
        ["/usr/sbin/runuser", "-u", user, "--", "/usr/bin/python3", "-c", SQUATTER, path,
         str(report)],
        start_new_session=True,  # runuser and its python child: one group to end
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not (report.exists() and "listening" in report.read_text()):
        assert squatter.poll() is None and time.monotonic() < deadline, "squatter failed"
        time.sleep(0.1)
    return squatter


def _stop(squatter: subprocess.Popen) -> None:
    """End runuser and the squatter it started (killing runuser alone left the squatter
    running, and the user it runs as could then not be deleted)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(squatter.pid, signal.SIGKILL)
    squatter.wait(timeout=30)


def _job_env(shared: str, run_id: str) -> dict[str, str]:
    env = {**os.environ, ENV_RUN_ID: run_id, "PYTHONPATH": REPO, "TMPDIR": shared,
           "AWS_SECRET_ACCESS_KEY": "the-secret-of-this-job"}  # fmt: skip
    env.pop("XDG_RUNTIME_DIR", None)
    return env


@pytest.fixture
def shared_tmp():
    """A sticky world-writable directory like /tmp, the job's TMPDIR."""
    shared = tempfile.mkdtemp(prefix="squat-", dir="/tmp")  # pytest's own dir is 0700
    os.chmod(shared, 0o1777)
    yield shared
    shutil.rmtree(shared, ignore_errors=True)


def test_a_squatter_of_the_private_directory_gets_nothing_and_the_job_runs_warm(
    tmp_path, other_user, shared_tmp
):
    run_id = f"run-{secrets.token_hex(4)}"
    taken = os.path.join(shared_tmp, f"warmstart-{os.geteuid()}")
    report = pathlib.Path(shared_tmp) / "squatter.txt"
    # It cannot know the agent's pid: it listens on every name it could guess, here one.
    squatter = _squat(other_user, os.path.join(taken, "guess.sock"), report)
    try:
        target = tmp_path / "train.py"
        marker = tmp_path / "trained"
        target.write_text(f"open({str(marker)!r}, 'a').write('ok')\n")
        out = tmp_path / "launcher.err"
        proc = subprocess.run(
            [sys.executable, "-c", AGENT, run_id, str(target), str(out)],
            env=_job_env(shared_tmp, run_id), capture_output=True, text=True, timeout=150,
            check=False,
        )  # fmt: skip
        first, second = (pathlib.Path(f"{out}.{i}").read_text() for i in (0, 1))
        assert proc.returncode == 0, proc.stderr + first + second
        assert marker.read_text() == "okok"  # both attempts trained
        assert f"warm-start directory {taken}: it belongs to uid" in first, first
        assert "running cold, starting one for restarts" in first, first
        assert "running cold" not in second, second  # the zygote in warmstart-<uid>-1 served
        ours = pathlib.Path(f"{taken}-1")
        assert ours.stat().st_uid == os.geteuid() and ours.stat().st_mode & 0o777 == 0o700
    finally:
        _stop(squatter)
    said = report.read_text()
    assert "listening" in said and "connected" not in said, said


def test_a_listener_of_another_user_in_the_private_directory_is_sent_nothing(
    tmp_path, other_user, shared_tmp
):
    run_id = f"run-{secrets.token_hex(4)}"
    env = _job_env(shared_tmp, run_id)
    ours = os.path.join(shared_tmp, f"warmstart-{os.geteuid()}")
    os.mkdir(ours, 0o700)
    _lock, serve = socket_names(os.getpid(), run_id, ours)  # the launcher's parent: this process
    report = pathlib.Path(shared_tmp) / "squatter.txt"
    elsewhere = os.path.join(shared_tmp, "elsewhere", "s.sock")
    squatter = _squat(other_user, elsewhere, report)
    try:
        os.rename(elsewhere, serve)  # only root can put it there
        target = tmp_path / "train.py"
        marker = tmp_path / "trained"
        target.write_text(f"open({str(marker)!r}, 'w').write('ok')\n")
        proc = subprocess.run(
            [sys.executable, "-m", "warmstart", str(target)],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert marker.read_text() == "ok"  # the job ran, cold
        assert "not by this user" in proc.stderr and "running cold" in proc.stderr
        squatter.wait(timeout=30)
    finally:
        _stop(squatter)
    said = report.read_text()
    assert "the-secret-of-this-job" not in said
    assert "connected, 0 bytes" in said or "no connection" in said, said
