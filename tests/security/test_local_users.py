"""Another local user cannot take what a job hands to its warm-start zygote.

The launcher (``python -m warmstart``) connects to an abstract Unix socket whose name
anyone on the host can see and bind first. It used to send whoever listened the job's
whole environment (cloud credentials, tokens) and its stdio, and to signal or SIGKILL any
pid the listener named. A real second user is made for the test (``useradd``; root only),
its squatter binds the name first; the job runs cold, says so, and the squatter receives
nothing.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from warmstart.protocol import ENV_RUN_ID, socket_names

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(120)

SQUATTER = r"""
import socket, sys, time
name, out = sys.argv[1].encode().replace(b"\\0", b"\0"), sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(name)
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


def test_a_squatter_of_another_user_gets_nothing_and_the_job_runs_cold(tmp_path, other_user):
    shared = tempfile.mkdtemp(prefix="squat-", dir="/tmp")  # pytest's own dir is 0700
    os.chmod(shared, 0o777)
    run_id = f"run-{secrets.token_hex(4)}"
    _lock, serve = socket_names(os.getpid(), run_id)  # the launcher's parent: this process
    report = pathlib.Path(shared) / "squatter.txt"
    squatter = subprocess.Popen(
        ["/usr/sbin/runuser", "-u", other_user, "--", "/usr/bin/python3", "-c", SQUATTER,
         serve.replace("\0", "\\0"), str(report)],
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (report.exists() and "listening" in report.read_text()):
            assert squatter.poll() is None and time.monotonic() < deadline, "squatter failed"
            time.sleep(0.1)
        target = tmp_path / "train.py"
        marker = tmp_path / "trained"
        target.write_text(f"open({str(marker)!r}, 'w').write('ok')\n")
        env = {**os.environ, ENV_RUN_ID: run_id, "PYTHONPATH": REPO,
               "AWS_SECRET_ACCESS_KEY": "the-secret-of-this-job"}  # fmt: skip
        proc = subprocess.run(
            [sys.executable, "-m", "warmstart", str(target)],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert marker.read_text() == "ok"  # the job ran, cold
        assert "not by this user" in proc.stderr and "running cold" in proc.stderr
        squatter.wait(timeout=30)
        said = report.read_text()
        assert "the-secret-of-this-job" not in said
        assert "connected, 0 bytes" in said or "no connection" in said, said
    finally:
        if squatter.poll() is None:
            squatter.kill()
            squatter.wait()
        shutil.rmtree(shared, ignore_errors=True)
