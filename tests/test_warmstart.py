"""The warm-start launcher and its zygote, with a stand-in for torchrun's agent.

The agent here (``AGENT``) does what torchrun does to a worker: start ``python -u -m
warmstart ...`` with ``TORCHELASTIC_RUN_ID`` set, in a session of its own, wait for it,
and start the next attempt. Attempt 0 starts the zygote; later attempts are forked from
it. The zygote imports nothing here (``WARMSTART_PRELOAD=""``) to keep the tests fast;
torch under real torchrun is tests/e2e/test_warmstart_e2e.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from testing.local_cluster import REPO
from warmstart.launcher import UsageError, parse
from warmstart.protocol import Target

pytestmark = pytest.mark.timeout(120)

AGENT = r"""
import json, os, socket, subprocess, sys, time
from warmstart.protocol import runtime_dir, socket_names
run_id, out_dir, attempts = sys.argv[1], sys.argv[2], int(sys.argv[3])
launcher_args = sys.argv[4:]
_, serve = socket_names(os.getpid(), run_id, runtime_dir()[0])
for attempt in range(attempts):
    if attempt:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the zygote serves once its imports are done
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(serve)
                break
            except OSError:
                time.sleep(0.05)
            finally:
                s.close()
    args = [a.replace("{attempt}", str(attempt)) for a in launcher_args]
    with open(f"{out_dir}/attempt{attempt}.out", "w") as out, \
            open(f"{out_dir}/attempt{attempt}.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-u", "-m", "warmstart", *args],
                                stdout=out, stderr=err, start_new_session=True)
    print(json.dumps({"attempt": attempt, "launcher": proc.pid}), flush=True)
    print(json.dumps({"attempt": attempt, "rc": proc.wait()}), flush=True)
"""

TARGET = r"""
import json, os, signal, sys, time
mode = sys.argv[1]
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("WS_TEST"),
                  "pid": os.getpid(), "path0": sys.path[0], "name": __name__}), flush=True)
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "term":
    def on_term(signum, frame):
        open(sys.argv[2], "w").write("got SIGTERM")
        sys.exit(143)
    signal.signal(signal.SIGTERM, on_term)
if mode in ("term", "sleep"):
    open(sys.argv[2] + ".ready", "w").write(str(os.getpid()))
    time.sleep(60)
    sys.exit(3)
"""


class Agent:
    def __init__(self, tmp_path, attempts: int, *launcher_args: str) -> None:
        self.run_id = uuid.uuid4().hex
        self.dir = str(tmp_path)
        env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
        env.update(TORCHELASTIC_RUN_ID=self.run_id, WARMSTART_PRELOAD="", WS_TEST="from-agent",
                   PYTHONPATH=REPO, RANK="0")  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-c", AGENT, self.run_id, self.dir, str(attempts), *launcher_args],
            stdout=subprocess.PIPE, text=True, env=env, cwd=self.dir,
        )  # fmt: skip
        self.started: list[int] = []

    def next_line(self, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        line = ""
        while time.monotonic() < deadline and not line:
            line = self.proc.stdout.readline()  # the agent prints promptly; EOF if it died
            if not line and self.proc.poll() is not None:
                break
        assert line, f"agent printed nothing (rc={self.proc.poll()})"
        row = json.loads(line)
        if "launcher" in row:
            self.started.append(row["launcher"])
        return row

    def output(self, attempt: int) -> tuple[dict, str]:
        with open(os.path.join(self.dir, f"attempt{attempt}.out")) as f:
            first = f.readline()
        with open(os.path.join(self.dir, f"attempt{attempt}.err")) as f:
            err = f.read()
        return (json.loads(first) if first else {}), err

    def close(self, extra: list[int] = ()) -> None:
        for pid in [*extra, *self.started]:
            _kill(pid)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"waited {timeout_s} s for {what}")


def _zygotes(run_id: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
            except OSError:
                continue
            if b"warmstart.zygote" in cmd and run_id.encode() in cmd and _state(int(entry)) != "Z":
                out.append(int(entry))
    return out


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "target.py"
    path.write_text(TARGET)
    return str(path)


def test_second_attempt_is_forked_with_argv_env_cwd_and_exit_code(tmp_path, target):
    agent = Agent(tmp_path, 2, target, "exit", "5", "--flag={attempt}")
    try:
        rows = [agent.next_line() for _ in range(4)]
        assert agent.proc.wait(30) == 0
    finally:
        agent.close()
    assert [r["rc"] for r in rows if "rc" in r] == [5, 5]
    launchers = [r["launcher"] for r in rows if "launcher" in r]
    cold, cold_err = agent.output(0)
    warm, warm_err = agent.output(1)
    assert "running cold" in cold_err and "warm start" not in cold_err
    assert f"warm start: worker pid {warm['pid']}" in warm_err
    assert cold["pid"] == launchers[0]  # attempt 0 ran in the launcher itself
    assert warm["pid"] != launchers[1]  # attempt 1 ran in a child of the zygote
    for out, attempt in ((cold, 0), (warm, 1)):
        assert out["argv"] == [target, "exit", "5", f"--flag={attempt}"]
        assert out["cwd"] == str(tmp_path)
        assert out["env"] == "from-agent"
        assert out["path0"] == str(tmp_path)  # the script's directory, like `python script`
        assert out["name"] == "__main__"
    _wait(lambda: not _zygotes(agent.run_id), 10, "the zygote to exit after its agent")


def test_child_killed_by_a_signal_is_reported_as_that_signal(tmp_path, target):
    agent = Agent(tmp_path, 2, target, "sigkill")
    try:
        rows = [agent.next_line() for _ in range(4)]
    finally:
        agent.close()
    assert [r["rc"] for r in rows if "rc" in r] == [-signal.SIGKILL, -signal.SIGKILL]
    assert "warm start" in agent.output(1)[1]


def test_sigterm_reaches_the_child_and_its_exit_code_comes_back(tmp_path, target):
    marker = str(tmp_path / "term_{attempt}")
    agent = Agent(tmp_path, 2, target, "term", marker)
    try:
        assert "launcher" in agent.next_line()
        launcher0 = agent.started[0]
        _wait(lambda: os.path.exists(str(tmp_path / "term_0.ready")), 30, "attempt 0 ready")
        os.kill(launcher0, signal.SIGTERM)  # cold: the launcher is the worker
        assert agent.next_line() == {"attempt": 0, "rc": 143}
        assert "launcher" in agent.next_line()
        _wait(lambda: os.path.exists(str(tmp_path / "term_1.ready")), 30, "attempt 1 ready")
        os.kill(agent.started[1], signal.SIGTERM)  # warm: forwarded to the forked child
        assert agent.next_line() == {"attempt": 1, "rc": 143}
    finally:
        agent.close()
    assert (tmp_path / "term_1").read_text() == "got SIGTERM"
    child = int((tmp_path / "term_1.ready").read_text())
    assert child != agent.started[1]


def test_killed_or_stopped_launcher_takes_its_child_along(tmp_path, target):
    ready = str(tmp_path / "sleep_{attempt}")
    agent = Agent(tmp_path, 3, target, "sleep", ready)
    children: list[int] = []
    try:
        agent.next_line()
        _wait(lambda: os.path.exists(str(tmp_path / "sleep_0.ready")), 30, "attempt 0 ready")
        os.kill(agent.started[0], signal.SIGKILL)
        assert agent.next_line() == {"attempt": 0, "rc": -signal.SIGKILL}

        # Attempt 1: the launcher is frozen -> so is its child; thawed -> running again.
        agent.next_line()
        _wait(lambda: os.path.exists(str(tmp_path / "sleep_1.ready")), 30, "attempt 1 ready")
        child = int((tmp_path / "sleep_1.ready").read_text())
        children.append(child)
        assert child != agent.started[1]
        os.kill(agent.started[1], signal.SIGSTOP)
        _wait(lambda: _state(child) == "T", 5, "the child to stop with its launcher")
        os.kill(agent.started[1], signal.SIGCONT)
        _wait(lambda: _state(child) in ("S", "R"), 5, "the child to continue with its launcher")
        # Killed launcher (as torchrun's SIGKILL after its grace period): the child dies.
        os.kill(agent.started[1], signal.SIGKILL)
        _wait(lambda: _state(child) in ("", "Z"), 5, "the child to die with its launcher")
        assert agent.next_line() == {"attempt": 1, "rc": -signal.SIGKILL}

        # Attempt 2: a launcher killed while frozen leaves no stopped child behind.
        agent.next_line()
        _wait(lambda: os.path.exists(str(tmp_path / "sleep_2.ready")), 30, "attempt 2 ready")
        child = int((tmp_path / "sleep_2.ready").read_text())
        children.append(child)
        os.kill(agent.started[2], signal.SIGSTOP)
        _wait(lambda: _state(child) == "T", 5, "the child to stop with its launcher")
        os.kill(agent.started[2], signal.SIGKILL)
        _wait(lambda: _state(child) in ("", "Z"), 5, "the stopped child to be killed")
        assert agent.next_line() == {"attempt": 2, "rc": -signal.SIGKILL}
        assert agent.proc.wait(10) == 0
        _wait(lambda: not _zygotes(agent.run_id), 10, "the zygote to exit after its agent")
    finally:
        agent.close(children)


def test_outside_torchrun_the_target_runs_in_the_launcher(tmp_path, target):
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    env.update(PYTHONPATH=REPO, WS_TEST="plain")
    proc = subprocess.run(
        [sys.executable, "-u", "-m", "warmstart", target, "exit", "4"],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 4, proc.stderr
    out = json.loads(proc.stdout.splitlines()[0])
    assert out["env"] == "plain" and out["name"] == "__main__"
    assert proc.stderr == ""  # no zygote, nothing said


def test_missing_script_is_a_clear_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    env.update(PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "warmstart", str(tmp_path / "nope.py")],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "nope.py" in proc.stderr and "no such file" in proc.stderr


def test_parse_options_then_target():
    assert parse(["-m", "trainer", "--config", "x"]) == (
        False, [], Target(module="trainer", path=None, args=["--config", "x"]),
    )  # fmt: skip
    cold, preload, target = parse(["--cold", "--preload", "a,b", "--preload=c", "s.py", "-m", "z"])
    assert cold and preload == ["a", "b", "c"]
    assert target == Target(module=None, path="s.py", args=["-m", "z"])
    for bad, message in ((["--preload"], "--preload needs"), (["-m"], "-m needs"),
                         (["--nope", "s.py"], "unknown option '--nope'"), ([], "no target")):  # fmt: skip
        with pytest.raises(UsageError, match=message):
            parse(bad)


EDITING_TARGET = r"""
import json, os, sys, time
import wsmod  # preloaded and watched by the zygote (--preload wsmod)
print(json.dumps({"value": wsmod.VALUE, "pid": os.getpid()}), flush=True)
if sys.argv[1] == "1":  # between this attempt and the next, the module is edited
    path = wsmod.__file__
    with open(path, "w") as f:
        f.write("VALUE = 2\n")
    later = time.time() + 10
    os.utime(path, (later, later))
"""


def test_an_edited_watched_module_is_never_run_stale(tmp_path):
    # A module the zygote preloads and watches (--preload; ckpt and elastic by default)
    # changes between two attempts: the next worker runs cold with the new code, the
    # old zygote lets go, and a fresh one serves the attempt after (warm, new code).
    (tmp_path / "wsmod.py").write_text("VALUE = 1\n")
    script = tmp_path / "edit_target.py"
    script.write_text(EDITING_TARGET)
    agent = Agent(tmp_path, 4, "--preload", "wsmod", str(script), "{attempt}")
    try:
        rows = [agent.next_line() for _ in range(8)]
        assert agent.proc.wait(30) == 0
    finally:
        agent.close()
    assert [r["rc"] for r in rows if "rc" in r] == [0, 0, 0, 0]
    outs = [agent.output(a) for a in range(4)]
    assert [o["value"] for o, _ in outs] == [1, 1, 2, 2]
    assert "warm start" in outs[1][1] and "warm start" in outs[3][1]
    stale = outs[2][1]
    assert "wsmod.py changed since the warm interpreter imported it" in stale, stale
    assert "running cold, starting a fresh one" in stale and "warm start" not in stale
    launchers = [r["launcher"] for r in rows if "launcher" in r]
    assert outs[2][0]["pid"] == launchers[2]  # attempt 2 ran in its launcher (cold)
    _wait(lambda: not _zygotes(agent.run_id), 10, "both zygotes to exit after their agent")


def test_the_zygote_watches_the_library_by_default_and_sees_a_changed_file(tmp_path):
    from warmstart import launcher, zygote

    assert launcher.DEFAULT_WATCHED == ("ckpt", "elastic")
    assert not set(launcher.DEFAULT_WATCHED) & set(launcher.DEFAULT_PRELOAD)
    sources = zygote.watched_sources(["warmstart"])
    assert zygote.__file__ in sources and launcher.__file__ in sources
    assert all(path.endswith(".py") for path in sources)
    assert zygote.changed_source(sources) is None
    copy = tmp_path / "m.py"
    copy.write_text("x = 1\n")
    st = os.stat(copy)
    recorded = {str(copy): (st.st_mtime_ns, st.st_size)}
    assert zygote.changed_source(recorded) is None
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert zygote.changed_source(recorded) == str(copy)
    copy.unlink()
    assert zygote.changed_source(recorded) == str(copy)


def test_a_starting_zygote_sweeps_what_killed_zygotes_left_and_keeps_a_live_ones(request):
    # A zygote SIGKILLed (or OOM-killed) leaves its lock and socket files; a runtime dir
    # that outlives jobs would fill with them. The next zygote removes those no live
    # process holds, and nothing else.
    # A short path: a socket's path is at most 107 bytes, and a longer runtime dir is
    # passed over for the next candidate.
    runtime = pathlib.Path(tempfile.mkdtemp(prefix="ws-"))
    request.addfinalizer(lambda: shutil.rmtree(runtime, ignore_errors=True))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "PYTHONPATH": REPO}
    directory = runtime / "warmstart"
    directory.mkdir(mode=0o700)
    dead, live, sockless = "0" * 24, "a" * 24, "b" * 24
    for stem in (dead, live):
        (directory / f"{stem}.lock").write_bytes(b"")
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(directory / f"{stem}.sock"))  # left bound, as by a killed zygote
    (directory / f"{sockless}.sock").write_bytes(b"")  # a socket whose lock is gone
    (directory / "notes.txt").write_text("not the zygote's")
    (directory / ("c" * 23 + ".lock")).write_bytes(b"")  # not a name the zygote makes
    holder = os.open(directory / f"{live}.lock", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live zygote's lock
    try:
        # An agent that is already gone: the zygote sweeps, serves nobody and exits,
        # taking its own names with it.
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        proc = subprocess.run(
            [sys.executable, "-m", "warmstart.zygote", str(gone.pid), "sweep-run", "json"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        left = sorted(os.listdir(directory))
    finally:
        os.close(holder)
    assert left == sorted(
        [f"{live}.lock", f"{live}.sock", "notes.txt", "c" * 23 + ".lock"]
    ), left
