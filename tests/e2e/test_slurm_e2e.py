"""End-to-end: ``examples/recipes/slurm.sbatch`` submitted to a real Slurm cluster.

Each test brings up its own cluster (testing/slurm.py: munged, slurmctld and 3 slurmd
"nodes" ``n1..n3``, each in a network namespace of its own with its own address and
hostname), submits the recipe itself with ``sbatch`` and the environment knobs it
documents (``CKPT_DIR``, ``RUN_DIR``, ``GRACE_S``, ``STANDALONE_STORE``; trainer
arguments after the script name), and asserts on the job's run dir (metrics.jsonl,
events.jsonl), its checkpoints and Slurm's record of the job (``scontrol show job``:
state, exit code, restarts; ``sacct --completion``, which reads the job completion log
because there is no slurmdbd here). Losses are compared bit for bit with one
uninterrupted 2-rank run of the same trainer arguments.

Also: ``examples/recipes/multinode.sh`` on 3 namespace hosts without Slurm, and a cluster
that cannot start (its error names the daemon and shows its log). The whole file takes
about 5-6 min on 2 busy CPU cores (each job about a minute; the reference run 20-35 s).

Slurm missing is a failure that names the install command (scripts/test.sh installs it
as root), never a skip. Every cluster is torn down at the end of its test, and the test
asserts that no daemon, namespace or file is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from testing.gcs_emulator import emulator_env
from testing.local_cluster import descendants
from testing.netns import netns_unavailable
from testing.procs import MICRO_BATCH, torchrun_trainer
from testing.slurm import (
    FINAL_STATES,
    REPO,
    NamedHosts,
    SlurmCluster,
    SlurmClusterError,
    slurm_unavailable,
)

pytestmark = [pytest.mark.e2e]

RECIPE = "examples/recipes/slurm.sbatch"
STEPS = 100
EVERY = 20
TRAINER_ARGS = [
    "--max-steps", str(STEPS), "--ckpt-every", str(EVERY),
    "--set", "run.log_every=1", "--set", "run.save_final=true",
    "--set", "data.corpus_chars=20000", "--set", MICRO_BATCH,
]  # fmt: skip
DONE = set(FINAL_STATES)


# -- helpers ------------------------------------------------------------------------------------


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Submitted:
    """One submitted job: its id, run dir, checkpoint dir and sbatch output."""

    def __init__(self, cluster: SlurmCluster, workdir: str, job_id: str, ckpt_dir: str) -> None:
        self.cluster, self.job_id, self.ckpt_dir = cluster, job_id, ckpt_dir
        self.run_dir = os.path.join(workdir, "run")
        self.output = os.path.join(workdir, "job.out")

    def metrics(self) -> list[dict]:
        return read_jsonl(os.path.join(self.run_dir, "metrics.jsonl"))

    def events(self, kind: str | None = None) -> list[dict]:
        rows = read_jsonl(os.path.join(self.run_dir, "events.jsonl"))
        return [e for e in rows if kind is None or e["event"] == kind]

    def log_tail(self, chars: int = 6000) -> str:
        try:
            with open(self.output, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return "(no job output)"

    def info(self) -> dict[str, str]:
        return self.cluster.job(self.job_id)

    def wait_done(self, timeout_s: float) -> dict[str, str]:
        try:
            return self.cluster.wait_job(self.job_id, DONE, timeout_s)
        except Exception as exc:
            raise AssertionError(f"{exc}\n--- job output:\n{self.log_tail()}") from None

    def wait_step(self, step: int, timeout_s: float, *, after: float = 0.0) -> dict:
        """The first metrics row at or past ``step`` logged after unix time ``after``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for row in self.metrics():
                if row["step"] >= step and row["time"] > after:
                    return row
            state = self.info()["JobState"]
            assert state not in DONE, f"job ended ({state}) before step {step}:\n{self.log_tail()}"
            time.sleep(0.3)
        raise AssertionError(f"step {step} not reached in {timeout_s} s:\n{self.log_tail()}")


def submit(
    cluster: SlurmCluster,
    workdir: str,
    *,
    sbatch_opts: list[str],
    env: dict[str, str] | None = None,
    ckpt_dir: str | None = None,
) -> Submitted:
    """``sbatch [opts] examples/recipes/slurm.sbatch TRAINER_ARGS`` from the repository."""
    ckpt_dir = ckpt_dir or os.path.join(workdir, "ckpt")
    job_env = cluster.env(
        {
            "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}",
            "CKPT_DIR": ckpt_dir,
            "RUN_DIR": os.path.join(workdir, "run"),
            "GRACE_S": "20",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
    )
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRAINER_FAULTS"):
        if env is None or name not in env:
            job_env.pop(name, None)
    output = os.path.join(workdir, "job.out")
    job_id = cluster.sbatch(
        [*sbatch_opts, f"--output={output}", RECIPE, *TRAINER_ARGS], env=job_env, cwd=REPO
    )
    return Submitted(cluster, workdir, job_id, ckpt_dir)


def assert_completed(job: Submitted, info: dict[str, str], *, world: int | None = 2) -> None:
    """COMPLETED with exit code 0 in scontrol and in the completion log; STEPS reached."""
    assert info["JobState"] == "COMPLETED", f"{info}\n{job.log_tail()}"
    assert info["ExitCode"] == "0:0", info
    records = job.cluster.sacct(job.job_id)
    assert records and records[-1]["State"] == "COMPLETED", records
    assert records[-1]["ExitCode"] == "0:0", records
    rows = job.metrics()
    assert rows and rows[-1]["step"] == STEPS, job.log_tail()
    if world is not None:
        assert rows[-1]["world_size"] == world
    assert job.events("finished"), job.log_tail()


def assert_losses_match(job: Submitted, reference: dict) -> None:
    """Every logged loss (repeated steps included) and the final parameters equal the
    uninterrupted run's, bit for bit."""
    for row in job.metrics():
        assert row["loss"] == reference["losses"][row["step"]], row
    got = torch.load(os.path.join(job.run_dir, "final_params.pt"), weights_only=True)
    assert set(got) == set(reference["params"])
    for name, tensor in reference["params"].items():
        assert torch.equal(tensor, got[name]), name


def assert_resumed_from_emergency_saves(job: Submitted, legs: int) -> list[int]:
    """Each of the first ``legs`` runs of the job ended with an emergency checkpoint at the
    step it stopped on, and the next run resumed from exactly that step. Returns the steps."""
    saves = [e["step"] for e in job.events("checkpoint_saved") if e.get("emergency")]
    resumes = [e["step"] for e in job.events("resume")]
    assert len(saves) >= legs, (saves, job.log_tail())
    for step in saves:
        assert step in resumes, f"no run resumed from emergency step {step}: {resumes}"
        starts = [e for e in job.events("start") if e["step"] == step]
        assert starts, f"no start at step {step}"
    preempted = job.events("preempted")
    claimed = [e["step"] for e in preempted if e.get("emergency_save")]
    # A preemption right after a periodic commit has nothing new to save: its emergency
    # save is that commit (no second checkpoint_saved event), which is as good.
    periodic = {e["step"] for e in job.events("checkpoint_saved") if not e.get("emergency")}
    assert set(saves) <= set(claimed), (saves, claimed)
    assert set(claimed) <= set(saves) | periodic, (claimed, saves, sorted(periodic))
    return saves


def first_step_after(job: Submitted, unix_time: float) -> dict:
    return next(r for r in job.metrics() if r["time"] > unix_time)


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def cluster(tmp_path) -> Iterator[SlurmCluster]:
    reason = slurm_unavailable()
    assert reason is None, reason  # a missing Slurm is a failure with the fix, never a skip
    c = SlurmCluster(3)
    try:
        yield c
    finally:
        daemons = list(c.daemons.values())
        namespaces = c.hosts.net.namespaces()
        etc = [os.path.join("/etc/netns", n) for n in namespaces]
        c.close()
        assert all(p.poll() is not None for p in daemons), "a Slurm daemon outlived close()"
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not [n for n in namespaces if n in listed], f"namespaces left: {listed}"
        assert not os.path.exists(c.dir), f"{c.dir} left behind"
        assert not [p for p in etc if os.path.exists(p)], "/etc/netns entries left behind"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One uninterrupted 2-rank run of TRAINER_ARGS: loss per step and final parameters."""
    work = str(tmp_path_factory.mktemp("slurm-reference"))
    run_dir = os.path.join(work, "run")
    result = torchrun_trainer(
        ["--config", "examples/tiny_gpt.toml", *TRAINER_ARGS,
         "--ckpt-dir", os.path.join(work, "ckpt"), "--run-dir", run_dir],
        cwd=REPO, nproc=2, timeout_s=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert rows[-1]["step"] == STEPS
    params = torch.load(os.path.join(run_dir, "final_params.pt"), weights_only=True)
    return {"losses": {r["step"]: r["loss"] for r in rows}, "params": params}


# -- scenarios ----------------------------------------------------------------------------------


@pytest.mark.timeout(360)
def test_two_nodes_survive_a_worker_kill_and_the_time_limit_and_match_an_uninterrupted_run(
    cluster, reference, tmp_path, record_property
):
    """Cases 1, 2 and 4 in one job of 2 nodes. Rank 1 is SIGKILLed at step 14: torchrun
    restarts the group. At step 30 the time limit is brought forward (``scontrol update
    TimeLimit``) so that the recipe's ``--signal=TERM@LEAD`` is due at once: an emergency
    checkpoint at the step it stopped on, the script requeues the job, and the requeued run
    (its time limit restored while it waits) resumes from that step and finishes.

    slurmctld checks time limits every 30 s, so the signal comes 0-30 s after the update;
    the trainer processes are paused (SIGSTOP) from the update until the signal reaches
    them, so that the run cannot reach the end first and the step is known."""
    lead_s = 150
    job = submit(
        cluster, str(tmp_path), sbatch_opts=["--nodes=2", "--time=10", f"--signal=TERM@{lead_s}"],
        env={"TRAINER_FAULTS": "kill:step=14:rank=1"},
    )  # fmt: skip
    row = job.wait_step(30, 150)
    assert row["restart_count"] == 1, f"no torchrun restart before step 30: {row}"
    elapsed_s = _runtime_s(job.info()["RunTime"])
    # The soonest whole minute that ends within the lead: the warning signal is due now,
    # and the hard limit leaves at least 20 s for the emergency save and the requeue.
    limit_min = int((elapsed_s + 20 + 30) // 60) + 1
    assert limit_min * 60 - elapsed_s <= lead_s
    paused = {node: descendants(step_agent(cluster, node)) for node in ("n1", "n2")}
    for pid in [p for pids in paused.values() for p in pids]:
        os.kill(pid, signal.SIGSTOP)
    paused_at_step = job.metrics()[-1]["step"]
    cluster.command(["scontrol", "update", f"JobId={job.job_id}", f"TimeLimit={limit_min}"])
    signalled_at = time.time()
    try:
        deadline = time.monotonic() + 45
        while not all(any(_signalled(p) for p in pids) for pids in paused.values()):
            assert time.monotonic() < deadline, "the time limit's SIGTERM never reached the workers"
            time.sleep(0.1)
        signal_s = time.time() - signalled_at
    finally:
        for pid in [p for pids in paused.values() for p in pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    pending = cluster.wait_job(job.job_id, {"PENDING"}, 60)
    assert pending["Restarts"] == "1", pending
    cluster.command(["scontrol", "update", f"JobId={job.job_id}", "TimeLimit=10"])
    info = job.wait_done(240)

    assert_completed(job, info)  # case 1
    rows = job.metrics()
    assert {r["world_size"] for r in rows} == {2}, "every run of the job trains on 2 nodes"
    # Case 2: the kill made torchrun restart the group, which resumed and went on.
    assert [r for r in rows if r["restart_count"] == 1 and r["step"] <= 30]
    # Case 4: SIGTERM from the time limit -> emergency checkpoint -> requeue -> resume there.
    assert info["Restarts"] == "1", info
    [saved] = assert_resumed_from_emergency_saves(job, legs=1)
    assert paused_at_step <= saved <= paused_at_step + 2, (paused_at_step, saved)
    records = job.cluster.sacct(job.job_id)
    assert len(records) == 2, f"one completion record per run: {records}"
    assert_losses_match(job, reference)
    stopped = next(e for e in job.events("preempted") if e["step"] == saved)
    first = first_step_after(job, stopped["time"])
    assert first["step"] == saved + 1
    seconds = first["time"] - stopped["time"]
    record_property("time_limit_to_requeued_first_step_s", round(seconds, 1))
    print(f"time limit: TERM {signal_s:.1f} s after the update, emergency save at step {saved}, "
          f"requeued job's first step {seconds:.1f} s after it")  # fmt: skip


def _tails(logs: dict[str, str]) -> dict[str, str]:
    out = {}
    for name, path in logs.items():
        with open(path, errors="replace") as f:
            out[name] = f.read()[-2000:]
    return out


def step_agent(cluster: SlurmCluster, node: str) -> int:
    """The pid of the torchrun agent on ``node``: the one task of the job's srun step."""
    procs = cluster.processes(node)
    steps = [pid for pid, cmd in procs.items() if cmd.startswith("slurmstepd: [") and ".0]" in cmd]
    assert len(steps) == 1, procs
    agents = [pid for pid in procs if _ppid(pid) == steps[0]]
    assert len(agents) == 1 and "torchrun" in procs[agents[0]], procs
    return agents[0]


def _signalled(pid: int) -> bool:
    """A process paused with SIGSTOP got the step's SIGTERM: slurmstepd sends the step's
    processes SIGCONT with it (then it runs again), or an agent forwarded SIGTERM alone
    (then it is pending until SIGCONT)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return True  # gone
    if not fields["State"].strip().startswith("T"):
        return True
    mask = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _runtime_s(text: str) -> float:
    """``scontrol``'s RunTime ``[D-]HH:MM:SS`` in seconds."""
    days, _, hms = text.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return (int(days or 0) * 24 + h) * 3600 + m * 60 + s


def wait_world_after(job: Submitted, world: int, after: float, timeout_s: float) -> dict:
    """The first metrics row at world size ``world`` logged after unix time ``after``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for row in job.metrics():
            if row["time"] > after and row["world_size"] == world:
                return row
        time.sleep(0.3)
    raise AssertionError(f"no step at world size {world} in {timeout_s} s:\n{job.log_tail()}")


@pytest.mark.timeout(300)
def test_a_lost_node_leaves_the_job_finishing_on_the_survivors(cluster, tmp_path, record_property):
    """Case 3: a 3-node job; node n3 dies at step 30 (its slurmd and every process on it
    SIGKILLed). With ``--no-kill`` the allocation survives, the other two agents drop n3
    and the job finishes at world size 2 without a requeue."""
    job = submit(cluster, str(tmp_path), sbatch_opts=["--nodes=3"])
    assert job.wait_step(30, 150)["world_size"] == 3
    lost_at = time.time()
    assert cluster.lose_node("n3"), "nothing was running on n3"
    first = wait_world_after(job, 2, lost_at, 120)
    info = job.wait_done(180)
    assert_completed(job, info, world=2)
    assert info["Restarts"] == "0", f"the job was requeued instead of shrinking: {info}"
    resumed = [e for e in job.events("resume") if e["time"] > lost_at]
    assert resumed and resumed[0]["old_world_size"] == 3 and resumed[0]["new_world_size"] == 2
    seconds = first["time"] - lost_at
    record_property("node_loss_to_first_step_s", round(seconds, 1))
    print(f"node loss: first step on the 2 survivors {seconds:.1f} s after n3 died")


@pytest.mark.timeout(300)
def test_standalone_store_survives_the_first_nodes_agent_killed(cluster, tmp_path):
    """Case 6: ``STANDALONE_STORE=1``, 3 nodes; at step 30 the torchrun agent on n1 (the
    batch host, where the store runs in the batch shell) is SIGKILLed with its workers; the
    agents on n2 and n3 continue at world size 2 and the job finishes."""
    job = submit(cluster, str(tmp_path), sbatch_opts=["--nodes=3"], env={"STANDALONE_STORE": "1"})
    assert job.wait_step(30, 150)["world_size"] == 3
    agent = step_agent(cluster, "n1")
    killed_at = time.time()
    for pid in [*descendants(agent), agent]:
        os.kill(pid, signal.SIGKILL)
    wait_world_after(job, 2, killed_at, 120)
    info = job.wait_done(180)
    assert_completed(job, info, world=2)
    assert info["Restarts"] == "0", f"the job was requeued instead of continuing: {info}"


@pytest.mark.timeout(360)
def test_preemption_and_scontrol_requeue_resume_with_checkpoints_on_gcs(
    cluster, reference, tmp_path, record_property
):
    """Case 5, with ``CKPT_DIR`` on the GCS emulator (running on host ctl). At step 30,
    ``scancel --signal=TERM`` (what a preempting scheduler sends): emergency checkpoint at the
    step it stopped on, the script requeues, the next run resumes there. Then ``scontrol
    requeue`` on the running job: the third run resumes from the newest committed
    checkpoint and finishes; every loss equals the uninterrupted run's."""
    endpoint = cluster.start_gcs_emulator("slurm-e2e")
    job = submit(
        cluster, str(tmp_path), sbatch_opts=["--nodes=2"], env=emulator_env(endpoint),
        ckpt_dir="gs://slurm-e2e/run",
    )  # fmt: skip
    job.wait_step(30, 150)
    cluster.command(["scancel", "--signal=TERM", job.job_id])
    pending = cluster.wait_job(job.job_id, {"PENDING"}, 60)
    assert pending["Restarts"] == "1", f"the script did not requeue the job: {pending}"
    [saved] = [e["step"] for e in job.events("checkpoint_saved") if e.get("emergency")]
    assert saved >= 30
    row = job.wait_step(saved + EVERY, 150, after=time.time())
    cluster.command(["scontrol", "requeue", job.job_id])
    pending = cluster.wait_job(job.job_id, {"PENDING"}, 90)
    assert pending["Restarts"] == "2", pending
    info = job.wait_done(180)

    assert_completed(job, info)
    assert info["Restarts"] == "2", info
    assert assert_resumed_from_emergency_saves(job, legs=1)[0] == saved
    resumes = job.events("resume")
    assert resumes[0]["step"] == saved and resumes[0]["url"].startswith("gs://slurm-e2e/run/")
    assert len(resumes) == 2 and resumes[1]["step"] >= row["step"] - EVERY, resumes
    assert len(job.cluster.sacct(job.job_id)) == 3, "one completion record per run"
    assert_losses_match(job, reference)


@pytest.mark.timeout(240)
def test_multinode_sh_trains_on_three_namespace_hosts(tmp_path):
    """``examples/recipes/multinode.sh node`` on 3 hosts (own address, hostname and
    /etc/hosts; no Slurm), ``RDZV_HOST`` set to the first host's name: the three agents
    form one job at world size 3 and train to the end."""
    reason = netns_unavailable()
    assert reason is None, reason
    hosts = NamedHosts(["h1", "h2", "h3"])
    work = str(tmp_path)
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}",
        "RDZV_HOST": "h1", "JOB": "multinode-e2e", "NPROC": "1",
        "CKPT_DIR": os.path.join(work, "ckpt"), "RUN_DIR": os.path.join(work, "run"),
        "PYTHONUNBUFFERED": "1",
    }  # fmt: skip
    logs, procs = {}, {}
    try:
        for name in hosts.hosts:
            logs[name] = os.path.join(work, f"{name}.log")
            with open(logs[name], "w") as log:
                procs[name] = hosts.popen(
                    name, ["bash", "examples/recipes/multinode.sh", "node", *TRAINER_ARGS],
                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
        deadline = time.monotonic() + 200
        codes: dict[str, int | None] = {}
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        assert codes == {"h1": 0, "h2": 0, "h3": 0}, (codes, _tails(logs))
    finally:
        hosts.close()
    rows = read_jsonl(os.path.join(work, "run", "metrics.jsonl"))
    assert rows and rows[-1]["step"] == STEPS and {r["world_size"] for r in rows} == {3}
    events = read_jsonl(os.path.join(work, "run", "events.jsonl"))
    assert [e for e in events if e["event"] == "finished"]


class _BrokenConfCluster(SlurmCluster):
    made: list[tuple[str, list[str]]] = []  # (temp dir, namespaces) of each attempt

    def _write_conf(self) -> None:
        super()._write_conf()
        self.made.append((self.dir, [h.netns for h in self.hosts.hosts.values()]))
        with open(self.conf, "a") as f:
            f.write("SelectType=select/no-such-plugin\n")


def test_a_cluster_that_cannot_start_says_which_daemon_and_shows_its_log():
    """slurmctld refuses a broken slurm.conf: the error names it with its log's tail, and
    the half-started cluster leaves no daemon, namespace or file behind."""
    with pytest.raises(SlurmClusterError, match=r"slurmctld exited with \d+") as failure:
        _BrokenConfCluster(1)
    assert "no-such-plugin" in str(failure.value), str(failure.value)
    [(temp_dir, namespaces)] = _BrokenConfCluster.made
    assert not os.path.exists(temp_dir), f"{temp_dir} left behind"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert namespaces and not [n for n in namespaces if n in listed], listed
    assert not [n for n in namespaces if os.path.exists(os.path.join("/etc/netns", n))]
