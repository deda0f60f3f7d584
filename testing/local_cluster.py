"""A local elastic cluster: several real torchrun agents on this machine.

Used by the end-to-end tests and the local demo (``examples/elastic_demo.py``) to
run a job the way a multi-node cluster does, with agents that can be killed,
SIGTERMed or added while it runs. Every agent is a ``torchrun`` process joining
one c10d rendezvous on 127.0.0.1.
The rendezvous store runs in a process of its own (``is_host=0`` on every agent),
so losing any agent, the first one included, does not end the job. Agents get the
settings the README recommends: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` and short
rendezvous timeouts.

Only processes this harness started are ever signalled: the store, the agents, and
the workers found as descendants of an agent (by pid, from /proc). Every wait has a
deadline; :meth:`ElasticJob.close` kills whatever is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from testing.ports import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RDZV_CONF = (
    "is_host=0,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=60"
)


def descendants(pid: int) -> list[int]:
    """Pids of every live descendant of ``pid`` (children first)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    frontier = [pid]
    while frontier:
        nxt = []
        for p in frontier:
            for c in children.get(p, []):
                out.append(c)
                nxt.append(c)
        frontier = nxt
    return out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class Agent:
    name: str
    proc: subprocess.Popen
    log_path: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@dataclass
class ElasticJob:
    """One elastic job: a standalone rendezvous store and the agents added to it.

    Agents run ``python -m <module> <trainer_args> --ckpt-dir <data_dir>/ckpt
    --run-dir <data_dir>/run``. Call :meth:`close` (or use ``with``) to stop
    everything that is still running.
    """

    workdir: str
    trainer_args: list[str]
    module: str = "trainer"
    nnodes: str = "2:4"
    max_restarts: int = 3
    rdzv_id: str = "e2e"
    env: dict[str, str] = field(default_factory=dict)
    data_dir: str = ""
    """Where ``run/`` and ``ckpt/`` live (default: workdir); a relaunch passes the old job's."""
    agents: list[Agent] = field(default_factory=list)

    def __post_init__(self) -> None:
        os.makedirs(self.workdir, exist_ok=True)
        self.port = free_port()
        self.store_log = os.path.join(self.workdir, "store.log")
        code = (
            "import sys, time\n"
            "from torch.distributed import TCPStore\n"
            "s = TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, wait_for_workers=False)\n"
            "print('ready', flush=True)\n"
            "time.sleep(3600)\n"
        )
        with open(self.store_log, "w") as log:
            self.store = subprocess.Popen(
                [sys.executable, "-c", code, str(self.port)], stdout=log, stderr=subprocess.STDOUT
            )
        self.wait_for(lambda: "ready" in _read_text(self.store_log), 60, "rendezvous store start")

    @property
    def run_dir(self) -> str:
        return os.path.join(self.data_dir or self.workdir, "run")

    @property
    def ckpt_dir(self) -> str:
        return os.path.join(self.data_dir or self.workdir, "ckpt")

    def add_agent(self, name: str | None = None, extra_args: list[str] | None = None) -> Agent:
        name = name or f"agent{len(self.agents)}"
        log_path = os.path.join(self.workdir, f"{name}.log")
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.nnodes}", "--nproc_per_node=1", f"--max_restarts={self.max_restarts}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{self.port}", f"--rdzv_id={self.rdzv_id}",
            f"--rdzv_conf={RDZV_CONF}", "--monitor_interval=0.1", "--local_addr=127.0.0.1",
            "-m", self.module, *self.trainer_args, *(extra_args or []),
            "--ckpt-dir", self.ckpt_dir, "--run-dir", self.run_dir,
        ]  # fmt: skip
        env = dict(os.environ)
        env.update(
            {
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": REPO,
            }
        )
        env.update(self.env)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        agent = Agent(name, proc, log_path)
        self.agents.append(agent)
        return agent

    # -- observing ----------------------------------------------------------------------

    def metrics(self) -> list[dict]:
        return _read_jsonl(os.path.join(self.run_dir, "metrics.jsonl"))

    def events(self) -> list[dict]:
        return _read_jsonl(os.path.join(self.run_dir, "events.jsonl"))

    def last_step(self) -> int:
        rows = self.metrics()
        return rows[-1]["step"] if rows else 0

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if predicate():
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"waited {timeout_s:.0f} s for {what}\n{self.logs_tail()}")

    def wait_agents(self, timeout_s: float, agents: list[Agent] | None = None) -> dict[str, int]:
        """Exit codes of ``agents`` (default: all); raises TimeoutError if any is still running."""
        agents = self.agents if agents is None else agents
        deadline = time.monotonic() + timeout_s
        for agent in agents:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                agent.proc.wait(remaining)
            except subprocess.TimeoutExpired:
                raise TimeoutError(
                    f"agent {agent.name} still running after {timeout_s:.0f} s\n{self.logs_tail()}"
                ) from None
        return {a.name: a.proc.returncode for a in agents}

    def logs_tail(self, chars: int = 3000) -> str:
        parts = []
        for agent in self.agents:
            try:
                parts.append(f"--- {agent.name} (rc={agent.proc.poll()}):\n{agent.log()[-chars:]}")
            except OSError:
                pass
        return "\n".join(parts)

    # -- failures -------------------------------------------------------------------------

    def worker_pids(self, agent: Agent) -> list[int]:
        return descendants(agent.pid)

    def kill_node(self, agent: Agent) -> None:
        """A lost machine: SIGKILL the agent and every process under it, at once."""
        pids = [agent.pid, *self.worker_pids(agent)]
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        agent.proc.wait(10)

    def sigterm_agent(self, agent: Agent) -> None:
        _signal(agent.pid, signal.SIGTERM)

    def __enter__(self) -> ElasticJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for agent in self.agents:
            if agent.proc.poll() is None:
                for pid in [agent.pid, *self.worker_pids(agent)]:
                    _signal(pid, signal.SIGKILL)
                try:
                    agent.proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        if self.store.poll() is None:
            self.store.kill()
            self.store.wait(10)


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line being written right now
    return rows


def _read_text(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()
