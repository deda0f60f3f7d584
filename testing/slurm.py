"""A real Slurm cluster on one machine: munged, slurmctld and N slurmd "nodes" in namespaces.

For end-to-end tests of ``examples/recipes/slurm.sbatch`` (and, without the daemons, of
``examples/recipes/multinode.sh``) on hosts that behave like separate machines:

- :class:`NamedHosts`: network namespaces on a bridge (:class:`testing.netns.VirtualNetwork`),
  each with its own ``10.x.y.z`` address, its own hostname (a UTS namespace per process
  started with :meth:`NamedHosts.popen`) and an ``/etc/hosts`` that names every host
  (``ip netns exec`` bind-mounts ``/etc/netns/NS/hosts`` over ``/etc/hosts``), so a node
  name resolves to its address as on a cluster with DNS.
- :class:`SlurmCluster`: one ``munged`` (its own key and socket under the cluster's temp
  dir), ``slurmctld`` on host ``ctl`` and one ``slurmd`` per node (``n1``, ``n2``, ...),
  each with its own spool, pid and log files; a generated ``slurm.conf``. Slurm commands
  run in the controller's namespace with ``SLURM_CONF`` set (:meth:`SlurmCluster.command`):
  the bridge is not reachable from the root namespace.
- :meth:`SlurmCluster.lose_node`: the node's slurmd and every process in its namespace
  SIGKILLed (a machine that died).
- :meth:`SlurmCluster.start_gcs_emulator`: fake-gcs-server on host ``ctl``, reachable from
  every node (the one in bench/harness/gcs_emulator.py listens on the root namespace's loopback).
- :meth:`SlurmCluster.close`: every daemon stopped by pid, every process left in the
  namespaces killed, the namespaces, the ``/etc/netns`` entries and the temp dir removed.

Accounting: Debian's 22.05 has no ``slurmdbd`` here, so ``sacct`` reads the job
completion log (``JobCompType=jobcomp/filetxt``, ``sacct --completion``): one record per
finished run of a job (its state and exit code); requeues and restarts come from
``scontrol show job`` (``Restarts=``), which keeps finished jobs for ``MinJobAge``.

Scheduling latency: the main scheduling loop runs every 2 s (``sched_interval``, 60 s by
default), so a requeued job starts as soon as it is eligible.

The requeue delay: Slurm holds a requeued batch job until the old job credential has
expired (``AuthInfo=cred_expire``, 120 s by default); this cluster sets it to
:data:`CRED_EXPIRE_S` so that tests do not wait two minutes.

Needs root and Debian's ``slurmctld slurmd slurm-client munge`` (:func:`slurm_unavailable`
says what to install). ``python -m testing.slurm submit`` brings a cluster up, submits the
recipe, waits for the job and tears the cluster down; ``python -m testing.slurm shell``
opens a shell in the controller's namespace with a cluster up until the shell exits.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from testing.netns import Host, VirtualNetwork

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBIAN_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
INSTALL_COMMAND = "apt-get install -y " + " ".join(DEBIAN_PACKAGES)
BINARIES = ("munged", "slurmctld", "slurmd", "slurmstepd", "sbatch", "scontrol", "sacct")
CRED_EXPIRE_S = 10
"""Job credential lifetime, which is also how long a requeued job waits to start again."""
SLURMD_TIMEOUT_S = 10
"""A node that does not answer slurmctld for this long is DOWN (the default is 300 s)."""
START_TIMEOUT_S = 30.0
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}
)
"""Job states that end a job for good (a requeued job goes back to PENDING instead)."""
NODE_CPUS = 16
"""CPUs each node claims (``SlurmdParameters=config_overrides``), so the recipe's
``--cpus-per-task=16`` fits as written."""

_CGROUP_PRELUDE = (
    "mount -t tmpfs slurm-cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd && "
    "mount -t cgroup -o none,name=etslurm etslurm /sys/fs/cgroup/systemd && "
)
"""slurmd 22.05 initializes its cgroup plugin even with proctrack/linuxproc and task/none,
and ``ip netns exec`` mounts a fresh /sys without /sys/fs/cgroup. A tmpfs there with an
empty named cgroup-v1 hierarchy (no controllers, not the host's systemd one; mounted only
in the daemon's mount namespace) makes it detect cgroup v1 and start."""


class SlurmClusterError(RuntimeError):
    """The cluster could not start or a Slurm command failed; the message has the logs."""


def slurm_unavailable() -> str | None:
    """Why a Slurm cluster cannot start here (what to run to fix it), or None."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        how = INSTALL_COMMAND if os.geteuid() == 0 else f"sudo {INSTALL_COMMAND}"
        return f"Slurm is not installed (missing {', '.join(missing)}): run `{how}`"
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (network namespaces, SlurmUser=root)"
    return None


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as exc:
        return f"({path}: {exc})"


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


class NamedHosts:
    """Hosts with an address, a hostname and an ``/etc/hosts`` naming all of them.

    ``names`` are created in order on one :class:`VirtualNetwork`. Start processes on a
    host with :meth:`popen` (its hostname is set in a UTS namespace of its own).
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.net = VirtualNetwork()
        self.hosts: dict[str, Host] = {}
        self._etc_dirs: list[str] = []
        try:
            for name in names:
                self.hosts[name] = self.net.add_host(name)
            table = "127.0.0.1 localhost\n" + "".join(
                f"{h.addr} {name}\n" for name, h in self.hosts.items()
            )
            for host in self.hosts.values():
                etc = os.path.join("/etc/netns", host.netns)
                os.makedirs(etc)
                self._etc_dirs.append(etc)
                with open(os.path.join(etc, "hosts"), "w") as f:
                    f.write(table)
        except BaseException:
            self.close()
            raise

    def wrap(self, name: str, cmd: Sequence[str], *, prelude: str = "") -> list[str]:
        """``cmd`` run on host ``name``: its namespace, its hostname (``exec``s, same pid).

        ``prelude``: shell commands run first in the host's mount namespace (the private
        one ``ip netns exec`` creates), e.g. to mount something only this host sees.
        """
        host = self.hosts[name]
        script = f'{prelude}hostname "$0" && exec "$@"'
        return host.wrap(["unshare", "--uts", "--", "sh", "-c", script, name, *cmd])

    def popen(
        self, name: str, cmd: Sequence[str], *, prelude: str = "", **kwargs
    ) -> subprocess.Popen:
        return subprocess.Popen(self.wrap(name, cmd, prelude=prelude), **kwargs)

    def pids(self, name: str) -> list[int]:
        """Every process running in host ``name``'s namespace."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.hosts[name].netns],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        return [int(p) for p in out.stdout.split()]

    def kill_all(self, name: str) -> list[int]:
        """SIGKILL every process in host ``name``'s namespace, until none is left."""
        killed: list[int] = []
        deadline = time.monotonic() + 10
        while (pids := self.pids(name)) and time.monotonic() < deadline:
            for pid in pids:
                _kill(pid)
            killed += pids
            time.sleep(0.2)
        return killed

    def close(self) -> None:
        """Kill what runs in the hosts, delete the namespaces and the ``/etc/netns`` entries."""
        for name in list(self.hosts):
            with contextlib.suppress(Exception):
                self.kill_all(name)
        self.net.close()
        for etc in self._etc_dirs:
            shutil.rmtree(etc, ignore_errors=True)
        self._etc_dirs.clear()


class SlurmCluster:
    """munged + slurmctld (host ``ctl``) + ``nodes`` slurmd hosts ``n1..nN``, partition ``debug``.

    Use as a context manager; :meth:`close` leaves no daemon, namespace or file behind.
    """

    def __init__(self, nodes: int = 3, *, workdir: str | None = None) -> None:
        reason = slurm_unavailable()
        if reason is not None:
            raise SlurmClusterError(reason)
        self.node_names = [f"n{i}" for i in range(1, nodes + 1)]
        self.dir = tempfile.mkdtemp(prefix="slurm-", dir=workdir)
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.daemons: dict[str, subprocess.Popen] = {}
        self.hosts: NamedHosts | None = None
        self.started_s = 0.0
        try:
            t0 = time.monotonic()
            self.hosts = NamedHosts(["ctl", *self.node_names])
            self._start_munged()
            self._write_conf()
            self._start("slurmctld", "ctl", ["slurmctld", "-D", "-f", self.conf])
            self._wait(lambda: self.command(["scontrol", "ping"], check=False).returncode == 0,
                       "slurmctld to answer `scontrol ping`", "slurmctld")  # fmt: skip
            for name in self.node_names:
                self._start(name, name, ["slurmd", "-D", "-N", name, "-f", self.conf])
            self._wait(self._nodes_idle, "every node to be idle in sinfo", *self.node_names)
            self.started_s = time.monotonic() - t0
        except BaseException:
            self.close()
            raise

    # -- start-up ---------------------------------------------------------------------------

    def _path(self, *parts: str) -> str:
        path = os.path.join(self.dir, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def log_path(self, daemon: str) -> str:
        if daemon == "munged":
            return self._path("munge", "munged.log")
        if daemon == "slurmctld":
            return self._path("ctl", "slurmctld.log")
        if daemon == "gcs":
            return self._path("ctl", "fake-gcs-server.log")
        return self._path("nodes", daemon, "slurmd.log")

    def _start_munged(self) -> None:
        munge_dir = os.path.join(self.dir, "munge")
        os.makedirs(munge_dir, mode=0o700)
        self.munge_socket = os.path.join(munge_dir, "munge.socket")
        key = os.path.join(munge_dir, "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o400), "wb") as f:
            f.write(secrets.token_bytes(1024))
        cmd = [
            "munged", "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={key}", f"--log-file={self.log_path('munged')}",
            f"--pid-file={os.path.join(munge_dir, 'munged.pid')}",
            f"--seed-file={os.path.join(munge_dir, 'munged.seed')}",
        ]  # fmt: skip
        with open(self.log_path("munged"), "a") as log:
            self.daemons["munged"] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        self._wait(lambda: os.path.exists(self.munge_socket), "munged's socket", "munged")

    def _write_conf(self) -> None:
        hosts = self.hosts.hosts
        nodes = "".join(
            f"NodeName={n} NodeAddr={hosts[n].addr} CPUs={NODE_CPUS} RealMemory=1000"
            " State=UNKNOWN\n"
            for n in self.node_names
        )
        node_dir = os.path.join(self.dir, "nodes", "%n")
        for name in self.node_names:
            os.makedirs(os.path.join(self.dir, "nodes", name, "spool"))
        os.makedirs(os.path.join(self.dir, "ctl", "state"), exist_ok=True)
        conf = f"""\
# Generated by testing/slurm.py for a throwaway cluster in network namespaces.
ClusterName=local{secrets.token_hex(2)}
SlurmctldHost=ctl({hosts["ctl"].addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={self.dir}/ctl/state
SlurmctldPidFile={self.dir}/ctl/slurmctld.pid
SlurmctldLogFile={self.log_path("slurmctld")}
SlurmdSpoolDir={node_dir}/spool
SlurmdPidFile={node_dir}/slurmd.pid
SlurmdLogFile={node_dir}/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/linear
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
ReturnToService=2
JobRequeue=1
SlurmdTimeout={SLURMD_TIMEOUT_S}
MinJobAge=3600
KillWait=30
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={self.dir}/ctl/jobcomp.txt
{nodes}PartitionName=debug Nodes={",".join(self.node_names)} Default=YES MaxTime=INFINITE State=UP
"""
        with open(self.conf, "w") as f:
            f.write(conf)

    def _start(self, key: str, host: str, cmd: list[str]) -> None:
        env = {**os.environ, "SLURM_CONF": self.conf}
        with open(self.log_path(key), "a") as log:  # the daemon keeps its own copy of the fd
            self.daemons[key] = self.hosts.popen(
                host, cmd, prelude=_CGROUP_PRELUDE, stdout=log, stderr=log, env=env
            )

    def _wait(self, ready, what: str, *daemons: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if ready():
                return
            for name in daemons:
                code = self.daemons[name].poll()
                if code is not None:
                    raise SlurmClusterError(
                        f"{name} exited with {code} while waiting for {what}; "
                        f"the end of its log ({self.log_path(name)}, removed with the cluster):"
                        f"\n{_tail(self.log_path(name))}"
                    )
            time.sleep(0.2)
        logs = "\n".join(f"--- {n}:\n{_tail(self.log_path(n))}" for n in daemons)
        raise SlurmClusterError(f"timed out after {START_TIMEOUT_S} s waiting for {what}\n{logs}")

    def _nodes_idle(self) -> bool:
        out = self.command(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.node_names)

    # -- use --------------------------------------------------------------------------------

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment for Slurm commands (and the jobs they submit: sbatch exports it)."""
        return {**os.environ, "SLURM_CONF": self.conf, **(extra or {})}

    def command(
        self,
        cmd: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        check: bool = True,
        timeout_s: float = 30,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (sbatch, scontrol, ...) on the controller's host."""
        result = subprocess.run(
            self.hosts.wrap("ctl", cmd), env=env or self.env(), cwd=cwd,
            capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise SlurmClusterError(
                f"{' '.join(cmd)} exited with {result.returncode}: "
                f"{result.stderr.strip() or result.stdout.strip()}"
            )
        return result

    def sbatch(self, args: Sequence[str], *, env: dict[str, str], cwd: str) -> str:
        """Submit a batch job; returns its id."""
        out = self.command(["sbatch", "--parsable", *args], env=env, cwd=cwd).stdout
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, NodeList, ...)."""
        out = self.command(["scontrol", "-o", "show", "job", job_id]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, states: set[str], timeout_s: float) -> dict[str, str]:
        """Poll until the job is in one of ``states``; raises with its record on timeout."""
        deadline = time.monotonic() + timeout_s
        info = self.job(job_id)
        while info["JobState"] not in states:
            if time.monotonic() > deadline:
                raise SlurmClusterError(
                    f"job {job_id} not in {sorted(states)} after {timeout_s} s: {info}"
                )
            time.sleep(0.5)
            info = self.job(job_id)
        return info

    def sacct(self, job_id: str) -> list[dict[str, str]]:
        """The job's records in the completion log: one per finished run (requeues included)."""
        fields = "JobID,State,ExitCode,NNodes"
        out = self.command(["sacct", "--completion", "-n", "-P", "-j", job_id, "-o", fields]).stdout
        keys = fields.split(",")
        return [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip()]

    def start_gcs_emulator(self, bucket: str, port: int = 4443) -> str:
        """fake-gcs-server (in-memory) on host ``ctl`` with ``bucket`` created; returns its
        endpoint (``http://ADDR:PORT``) for ``STORAGE_EMULATOR_HOST``. Stopped by :meth:`close`."""
        from testing.gcs_emulator import find_binary

        addr = self.hosts.hosts["ctl"].addr
        endpoint = f"http://{addr}:{port}"
        cmd = [
            find_binary(), "-scheme", "http", "-host", "0.0.0.0", "-port", str(port),
            "-external-url", endpoint, "-public-host", f"{addr}:{port}",
            "-backend", "memory", "-log-level", "warn",
        ]  # fmt: skip
        self._start("gcs", "ctl", cmd)
        create = (
            "import sys; from testing.gcs_emulator import create_bucket; "
            "create_bucket(sys.argv[1], sys.argv[2], timeout_s=2)"
        )

        def created() -> bool:
            probe = [sys.executable, "-c", create, endpoint, bucket]
            result = subprocess.run(
                self.hosts.wrap("ctl", probe), cwd=REPO, capture_output=True, timeout=30
            )
            return result.returncode == 0

        self._wait(created, f"fake-gcs-server on {endpoint}", "gcs")
        return endpoint

    def lose_node(self, name: str) -> list[int]:
        """The machine ``name`` dies: its slurmd and every process on it SIGKILLed."""
        daemon = self.daemons.get(name)
        if daemon is not None:
            _kill(daemon.pid)
        killed = self.hosts.kill_all(name)
        if daemon is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.wait(timeout=10)
        return killed

    def processes(self, name: str) -> dict[int, str]:
        """pid -> command line of every process on node ``name``."""
        out: dict[int, str] = {}
        for pid in self.hosts.pids(name):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
        return out

    def close(self) -> None:
        """Stop every daemon (by pid), kill what is left on the hosts, remove every file."""
        for proc in reversed(list(self.daemons.values())):
            if proc.poll() is None:
                _kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    _kill(proc.pid)
                    proc.wait(timeout=10)
        self.daemons.clear()
        if self.hosts is not None:
            self.hosts.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- command line -----------------------------------------------------------------------------


def _submit(args: argparse.Namespace) -> int:
    with SlurmCluster(args.nodes) as cluster:
        print(f"cluster up in {cluster.started_s:.1f} s: ctl + {', '.join(cluster.node_names)}")
        bindir = os.path.dirname(sys.executable)
        env = cluster.env({"PATH": f"{bindir}:{os.environ.get('PATH', '')}"})
        out_dir = os.path.join(REPO, "runs", time.strftime("slurm-local-%Y%m%d-%H%M%S"))
        env.setdefault("CKPT_DIR", os.path.join(out_dir, "ckpt"))
        env.setdefault("RUN_DIR", os.path.join(out_dir, "run"))
        os.makedirs(out_dir, exist_ok=True)
        output = os.path.join(out_dir, "job.out")
        print(f"CKPT_DIR={env['CKPT_DIR']} RUN_DIR={env['RUN_DIR']} output {output}")
        job_id = cluster.sbatch(
            ["--nodes=2", f"--output={output}", args.script, *args.trainer_args],
            env=env, cwd=REPO,
        )  # fmt: skip
        print(f"submitted job {job_id}; waiting (at most {args.timeout_s} s)")
        try:
            info = cluster.wait_job(job_id, set(FINAL_STATES), args.timeout_s)
        finally:
            print(_tail(output, 40))
        print(f"job {job_id}: {info['JobState']} exit {info['ExitCode']}")
        return 0 if info["JobState"] == "COMPLETED" else 1


def _shell(args: argparse.Namespace) -> int:
    with SlurmCluster(args.nodes) as cluster:
        print(f"cluster up in {cluster.started_s:.1f} s; SLURM_CONF={cluster.conf}")
        print("this shell runs on host ctl; exit it to tear the cluster down")
        return subprocess.call(cluster.hosts.wrap("ctl", ["bash", "-i"]), env=cluster.env())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testing.slurm",
        description="A throwaway Slurm cluster in network namespaces on this machine (root).",
    )
    parser.add_argument("--nodes", type=int, default=3, help="slurmd nodes (default 3)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    submit = sub.add_parser(
        "submit",
        help="bring a cluster up, submit a batch script on 2 nodes, wait; "
        "unknown arguments go to the script (the recipe passes them to the trainer)",
    )
    submit.add_argument("--script", default="examples/recipes/slurm.sbatch")
    submit.add_argument("--timeout-s", type=float, default=600)
    sub.add_parser("shell", help="bring a cluster up and open a shell on its controller host")
    args, extra = parser.parse_known_args(argv)
    if args.cmd == "shell":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return _shell(args)
    args.trainer_args = extra
    return _submit(args)


if __name__ == "__main__":
    sys.exit(main())
