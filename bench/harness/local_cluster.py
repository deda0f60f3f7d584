"""A local elastic cluster: several real torchrun agents on this machine.

Used by the end-to-end tests and the local demo (``examples/elastic_demo.py``) to
run a job the way a multi-node cluster does, with agents that can be killed,
frozen (SIGSTOP), SIGTERMed or added while it runs. Every agent is a ``torchrun``
process joining one rendezvous (``rdzv_backend``: c10d by default, or ``ft``), on
127.0.0.1 by default; with ``wrap`` and
``local_addr`` (``testing/netns.py``) each agent runs in a network namespace of its
own, on its own address.
The rendezvous store runs in a process of its own (``is_host=0`` on every agent),
so losing any agent, the first one included, does not end the job. Agents get the
settings docs/elastic.md recommends: short rendezvous timeouts, and with c10d
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (never with ``ft``, which needs none).

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

from bench.harness.ports import free_port

Wrap = Callable[[list[str]], list[str]]
"""Turns a command into one that runs elsewhere (``Host.wrap``: inside a namespace)."""

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""Where the packages are (a checkout, or site-packages of an installed wheel)."""

RDZV_CONF = "is_host=0,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5"
"""c10d's settings (whole seconds are its floor); ``join_timeout`` is the job's."""
FT_RDZV_CONF = "is_host=0"
"""``--rdzv_backend=ft`` (elastic/rendezvous.py): its sub-second defaults otherwise."""
BACKENDS = ("c10d", "ft")


def descendants(pid: int) -> list[int]:
    """Pids of every live descendant of ``pid`` (children first; zombies left out)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid_text = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):
            continue
        if state == "Z":
            continue  # exited, not yet reaped by its parent (e.g. an agent blocked in a store call)
        children.setdefault(int(ppid_text), []).append(int(entry))
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
    rdzv_backend: str = "c10d"
    """``c10d`` (with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as docs/elastic.md asks) or ``ft``
    (no variable needed: its workers never share the agent's store)."""
    env: dict[str, str] = field(default_factory=dict)
    data_dir: str = ""
    """Where ``run/`` and ``ckpt/`` live (default: workdir); a relaunch passes the old job's."""
    store_host: str = "127.0.0.1"
    """Address of the rendezvous store, as agents reach it."""
    store_wrap: Wrap | None = None
    """Where the store runs (default: here): e.g. ``Host.wrap`` of a namespace of its own."""
    join_timeout_s: int = 60
    """How long an agent waits for a round to reach min nodes before it gives up (exit 1):
    shorter where a scenario leaves one agent alone on purpose."""
    nproc_per_node: int = 1
    """Workers per agent (torchrun's ``--nproc_per_node``)."""
    agents: list[Agent] = field(default_factory=list)
    frozen: dict[str, list[int]] = field(default_factory=dict)
    """Pids SIGSTOPped by :meth:`freeze_node`, by agent name (killed, then continued, at close)."""

    def __post_init__(self) -> None:
        os.makedirs(self.workdir, exist_ok=True)
        # In a namespace of its own the store's port is free by construction.
        self.port = free_port() if self.store_wrap is None else 29400
        self.store_log = os.path.join(self.workdir, "store.log")
        code = (
            "import sys, time\n"
            "from torch.distributed import TCPStore\n"
            "s = TCPStore(sys.argv[2], int(sys.argv[1]), is_master=True, wait_for_workers=False)\n"
            "print('ready', flush=True)\n"
            "time.sleep(3600)\n"
        )
        cmd = [sys.executable, "-c", code, str(self.port), self.store_host]
        if self.store_wrap is not None:
            cmd = self.store_wrap(cmd)
        with open(self.store_log, "w") as log:
            self.store = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.wait_for(lambda: "ready" in _read_text(self.store_log), 60, "rendezvous store start")

    @property
    def rdzv_conf(self) -> str:
        conf = RDZV_CONF if self.rdzv_backend == "c10d" else FT_RDZV_CONF
        return f"{conf},join_timeout={self.join_timeout_s}"

    @property
    def run_dir(self) -> str:
        return os.path.join(self.data_dir or self.workdir, "run")

    @property
    def ckpt_dir(self) -> str:
        return os.path.join(self.data_dir or self.workdir, "ckpt")

    def add_agent(
        self,
        name: str | None = None,
        extra_args: list[str] | None = None,
        *,
        local_addr: str = "127.0.0.1",
        wrap: Wrap | None = None,
        env: dict[str, str] | None = None,
    ) -> Agent:
        """Start one torchrun agent (``nproc_per_node`` workers). ``local_addr``: the address it advertises
        (``--local_addr``); ``wrap``: where it runs (e.g. a namespace); ``env``: extra
        variables for this agent only (e.g. ``GLOO_SOCKET_IFNAME``)."""
        name = name or f"agent{len(self.agents)}"
        log_path = os.path.join(self.workdir, f"{name}.log")
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.nnodes}", f"--nproc_per_node={self.nproc_per_node}", f"--max_restarts={self.max_restarts}",
            f"--rdzv_backend={self.rdzv_backend}", f"--rdzv_endpoint={self.store_host}:{self.port}",
            f"--rdzv_id={self.rdzv_id}", f"--rdzv_conf={self.rdzv_conf}", "--monitor_interval=0.1",
            f"--local_addr={local_addr}",
            "-m", self.module, *self.trainer_args, *(extra_args or []),
            "--ckpt-dir", self.ckpt_dir, "--run-dir", self.run_dir,
        ]  # fmt: skip
        if wrap is not None:
            cmd = wrap(cmd)
        agent_env = env
        env = dict(os.environ)
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        for key in ("ELASTIC_FT_STORE", "ELASTIC_FT_NODE"):  # an agent's own (elastic/nodes.py)
            env.pop(key, None)
        env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO})
        if self.rdzv_backend == "c10d":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        env.update(self.env)
        env.update(agent_env or {})
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        agent = Agent(name, proc, log_path)
        self.agents.append(agent)
        return agent

    # -- observing ----------------------------------------------------------------------

    def metrics(self) -> list[dict]:
        return read_jsonl(os.path.join(self.run_dir, "metrics.jsonl"))

    def events(self) -> list[dict]:
        return read_jsonl(os.path.join(self.run_dir, "events.jsonl"))

    def all_events(self) -> list[dict]:
        """Events of every rank (``events.jsonl`` and ``events.rank*.jsonl``), by time."""
        rows: list[dict] = []
        if os.path.isdir(self.run_dir):
            for name in sorted(os.listdir(self.run_dir)):
                if name.startswith("events") and name.endswith(".jsonl"):
                    rows += read_jsonl(os.path.join(self.run_dir, name))
        return sorted(rows, key=lambda e: float(e.get("time", 0.0)))

    def agent_of_rank0(self, world_size: int) -> Agent | None:
        """The agent whose worker was global rank 0 in the latest group of ``world_size``
        (rank 0 logs ``rank 0: world_size=W`` at start, with a timestamp; workers log into
        their agent's log)."""
        marker = f"rank 0: world_size={world_size} "
        best: tuple[str, Agent] | None = None
        for agent in self.agents:
            try:
                lines = [line for line in agent.log().splitlines() if marker in line]
            except OSError:
                continue
            if lines and (best is None or lines[-1][:23] > best[0]):
                best = (lines[-1][:23], agent)
        return best[1] if best else None

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

    def freeze_node(self, agent: Agent) -> list[int]:
        """A frozen machine (hypervisor pause, a stuck kernel): SIGSTOP the agent and each of
        its workers (torchrun starts them in sessions of their own, so one process-group
        signal would not reach them). Returns the stopped pids; :meth:`close` kills them."""
        pids = [agent.pid, *self.worker_pids(agent)]
        self.frozen[agent.name] = pids
        for pid in pids:
            _signal(pid, signal.SIGSTOP)
        return pids

    def thaw_node(self, agent: Agent) -> None:
        """SIGCONT what :meth:`freeze_node` stopped."""
        for pid in self.frozen.pop(agent.name, []):
            _signal(pid, signal.SIGCONT)

    def __enter__(self) -> ElasticJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        # Frozen processes first: SIGKILL ends a stopped process without letting it run
        # again (a continued stale rank could still write), then SIGCONT for good measure.
        for pids in self.frozen.values():
            for pid in pids:
                _signal(pid, signal.SIGKILL)
                _signal(pid, signal.SIGCONT)
        self.frozen.clear()
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


def read_jsonl(path: str) -> list[dict]:
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
