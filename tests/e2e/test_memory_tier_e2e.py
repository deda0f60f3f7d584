"""End-to-end: the checkpoint manager's memory tier under real ``torchrun`` restarts.

Three scenarios, each checked against an uninterrupted run without the memory tier:

- A killed worker. examples/bring_your_own_model.py on 2 ranks (``torchrun``, one node),
  durable checkpoint every 6 steps, memory snapshot every step. Rank 1 is SIGKILLed at
  the start of step 9; torchrun restarts both workers, which must resume from the memory
  snapshot of step 8 (not the durable checkpoint of step 6) and reproduce the losses
  bitwise.
- A corrupted snapshot. The example's launch dies at step 9 (every rank SIGKILLed, no
  restart), leaving the memory snapshots of steps 7 and 8; one byte of rank 1's shard of
  step 8 is flipped (and, in a second case, one of rank 0's shard of step 7). A relaunch
  with the same rendezvous id (so it sees those snapshots) must reject each damaged
  snapshot (crc32c, a ``fallback`` event), resume from the next tier (the snapshot of
  step 7, or the durable checkpoint of step 6) and reproduce the losses bitwise.
- A lost node. The trainer (examples/tiny_gpt.toml) under two torchrun agents of one
  elastic job (``--nnodes=1:2``), each agent a node with a memory directory of its own.
  Rank 1 hangs at the start of step 14 (the last durable checkpoint is step 10); once the
  survivor holds rank 1's replica of step 13, the node without global rank 0 is
  SIGKILLed, agent and worker, and its memory directory deleted (its host memory is
  gone). The survivor restarts alone at world size 1 from the memory snapshot of step
  13, whose rank-1 shard now only exists as that replica, and must consume the same
  samples as the uninterrupted run, losses within the cross-world-size tolerance.

Every run has a hard deadline; only processes the tests started are killed, by pid.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import uuid

import pytest

import ckpt
from ckpt.format.checksum import crc32c_of
from ckpt.format.layout import shard_filename
from ckpt.tiers.memory.layout import read_commit
from testing.local_cluster import BACKENDS, REPO, ElasticJob
from testing.ports import free_port
from testing.procs import MICRO_BATCH, RunTimeoutError, run_bounded

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SCRIPT = os.path.join(REPO, "examples", "bring_your_own_model.py")
RUN_TIMEOUT_S = 90
STEPS = 12
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT", "TRAINER_FAULTS", "CKPT_MEMORY_DIR")  # fmt: skip

# The lost-node scenario (the trainer): durable checkpoints at 10 and 20 (the final one).
NODE_STEPS = 20
NODE_EVERY = 10
LOST_AFTER = 13
TRAINER_ARGS = [
    "--config", "examples/tiny_gpt.toml",
    "--max-steps", str(NODE_STEPS), "--ckpt-every", str(NODE_EVERY),
    "--set", "run.log_every=1", "--set", "data.corpus_chars=20000",
    "--set", MICRO_BATCH,
]  # fmt: skip
# Same samples on another world size, but gradients summed in another order: the
# tolerance of the trainer's resharding tests (tests/test_trainer_e2e.py), which a wrong
# sample, a gradient off by the world size or lost optimizer state all exceed.
CROSS_WORLD_LOSS_ATOL = 1e-4


def _run(
    tmp: str,
    name: str,
    memory_dir: str,
    *args: str,
    rdzv_id: str | None = None,
    max_restarts: int = 1,
    ok: bool = True,
) -> str:
    """One torchrun launch of the example on 2 ranks; returns its run dir.

    Checkpoints go to ``<tmp>/<name>_ckpt``, metrics and events to ``<tmp>/<name>_run``, so
    a second launch with the same ``name`` continues the first one's run. Without
    ``rdzv_id`` the launch is ``--standalone`` (a fresh rendezvous id, so no snapshot of
    an earlier launch is seen); with one, a c10d rendezvous of that id on this host: the
    memory tier's run key, so a relaunch with the same id finds the snapshots left behind.
    ``ok``: the launch must exit 0; else it must fail.
    """
    run_dir = os.path.join(tmp, f"{name}_run")
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               CKPT_MEMORY_DIR=memory_dir)  # fmt: skip
    if rdzv_id is None:
        rendezvous = ["--standalone"]
    else:
        rendezvous = ["--nnodes=1", "--rdzv_backend=c10d", f"--rdzv_id={rdzv_id}",
                      f"--rdzv_endpoint=127.0.0.1:{free_port()}"]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc_per_node=2",
           f"--max_restarts={max_restarts}", "--monitor_interval=0.5", SCRIPT,
           "--ckpt-dir", os.path.join(tmp, f"{name}_ckpt"), "--run-dir", run_dir,
           "--max-steps", str(STEPS), "--ckpt-every", "6", *args]  # fmt: skip
    try:
        proc = run_bounded(cmd, env=env, cwd=REPO, timeout_s=RUN_TIMEOUT_S)
    except RunTimeoutError as exc:
        pytest.fail(f"{name}: {exc}")
    out = proc.stdout
    if ok:
        assert proc.returncode == 0, out[-6000:]
    else:
        assert proc.returncode != 0, out[-6000:]
    return run_dir


def _jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _private_memory_dir() -> str:
    # tmpfs like the default /dev/shm/ckpt-memory-<uid>, but private to one test.
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return os.path.join(base or "/tmp", f"ckpt-memory-e2e-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def memory_dir():
    path = _private_memory_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def example_base(tmp_path_factory):
    """Per-step metrics of an uninterrupted run of the example, no memory tier (run once)."""
    tmp = str(tmp_path_factory.mktemp("memory_tier_base"))
    run_dir = _run(tmp, "base", os.path.join(tmp, "unused-memory-dir"))
    base = {r["step"]: r for r in _jsonl(os.path.join(run_dir, "metrics.jsonl"))}
    assert sorted(base) == list(range(1, STEPS + 1))
    return base


def _committed_slots(memory_dir: str) -> dict[tuple[str, int], str]:
    """``(holder dir name, step) -> slot dir`` of every committed slot under a memory dir."""
    out = {}
    for slot_dir in sorted(glob.glob(os.path.join(memory_dir, "*", "h*", "slot*"))):
        loaded = read_commit(slot_dir)
        if not isinstance(loaded, str):
            out[(os.path.basename(os.path.dirname(slot_dir)), loaded[0].step)] = slot_dir
    return out


def test_a_killed_worker_resumes_from_the_memory_snapshot_newer_than_the_durable_one(
    tmp_path, memory_dir, example_base
):
    tmp, base = str(tmp_path), example_base
    run_dir = _run(
        tmp, "killed", memory_dir, "--memory-every", "1", "--fault", "kill:step=9:rank=1"
    )
    rows = _jsonl(os.path.join(run_dir, "metrics.jsonl"))
    events = _jsonl(os.path.join(run_dir, "events.jsonl"))
    resumes = [e for e in events if e["event"] == "resume"]
    assert [(e["step"], e["tier"], e["new_world_size"]) for e in resumes] == [(8, "memory", 2)]
    assert resumes[0]["rng_restored"] is True
    choices = [e for e in events if e["event"] == "tier_choice"]
    assert [c["tier"] for c in choices] == ["none", "memory"]  # first start, then the restart
    assert "memory step 8 newer than durable 6" in choices[1]["reason"]
    # Steps 1-8 ran once, 9-12 after the restart; every loss is bitwise the uninterrupted one.
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["restart_count"] for r in rows] == [0] * 8 + [1] * 4
    for row in rows:
        assert row["loss"] == base[row["step"]]["loss"], row["step"]
        assert row["samples_digest"] == base[row["step"]]["samples_digest"], row["step"]
    assert not [e for e in events if e["event"] == "memory_snapshot_failed"]
    # The final durable checkpoint (step 12) supersedes the memory tier: nothing left in RAM.
    assert not glob.glob(os.path.join(memory_dir, "*", "h*", "slot*")), os.listdir(memory_dir)


def _flip_one_byte(slot_dir: str, rank: int) -> str:
    """Flip one bit of the middle byte of the largest item in rank ``rank``'s shard file of
    a committed slot (data, not padding: the manifest's chunks say where items are)."""
    name = shard_filename(rank)
    loaded = read_commit(slot_dir)
    assert not isinstance(loaded, str), loaded
    offset, length, _ = max(loaded[1].chunks[name], key=lambda chunk: chunk[1])
    path = os.path.join(slot_dir, name)
    with open(path, "r+b") as fh:
        fh.seek(offset + length // 2)
        byte = fh.read(1)[0]
        fh.seek(offset + length // 2)
        fh.write(bytes([byte ^ 0x01]))
    return path


@pytest.mark.parametrize(
    ("corrupt", "tier", "resumed"),
    [({8: 1}, "memory", 7), ({8: 1, 7: 0}, "durable", 6)],
    ids=["newest-snapshot", "both-snapshots"],
)
def test_a_corrupted_memory_snapshot_is_rejected_and_the_next_tier_used(
    tmp_path, memory_dir, example_base, corrupt, tier, resumed
):
    """``corrupt``: step -> the rank whose shard of that step gets one flipped byte."""
    tmp, base = str(tmp_path), example_base
    rdzv_id = f"corrupt-{uuid.uuid4().hex[:8]}"
    # Every rank SIGKILLs itself at the start of step 9 and nothing restarts it: the launch
    # fails with the durable checkpoint of step 6 and the memory snapshots of 7 and 8 left.
    memory = ["--memory-every", "1"]
    _run(tmp, "corrupt", memory_dir, *memory, "--fault", "kill:step=9", rdzv_id=rdzv_id,
         max_restarts=0, ok=False)  # fmt: skip
    assert ckpt.find_latest_committed(os.path.join(tmp, "corrupt_ckpt")).step == 6
    slots = _committed_slots(memory_dir)
    assert sorted(slots) == [("h00000", 7), ("h00000", 8), ("h00001", 7), ("h00001", 8)], slots
    flipped = {
        step: _flip_one_byte(slots[(f"h{rank:05d}", step)], rank) for step, rank in corrupt.items()
    }

    # The relaunch: same rendezvous id and root (the same run key), same run dir.
    run_dir = _run(tmp, "corrupt", memory_dir, *memory, rdzv_id=rdzv_id)
    events = _jsonl(os.path.join(run_dir, "events.jsonl"))
    fallbacks = [e for e in events if e["event"] == "fallback"]
    assert [(e["step"], e["tier"], e["path"]) for e in fallbacks] == [
        (step, "memory", shard_filename(rank)) for step, rank in corrupt.items()
    ], fallbacks
    for event in fallbacks:  # the whole-file check named the very copy that was damaged
        assert f"{flipped[event['step']]}: crc32c" in event["reason"], event
    choices = [e for e in events if e["event"] == "tier_choice"]
    assert [(c["tier"], c["step"]) for c in choices] == [("none", 0), (tier, resumed)]
    assert choices[1]["durable_step"] == 6
    for step in corrupt:
        assert f"memory step {step} rejected" in choices[1]["reason"], choices[1]
    if tier == "memory":
        assert f"memory step {resumed} newer than durable 6" in choices[1]["reason"]
    resumes = [e for e in events if e["event"] == "resume"]
    assert [(e["step"], e["tier"], e["new_world_size"]) for e in resumes] == [(resumed, tier, 2)]
    assert resumes[0]["rng_restored"] is True
    # Steps 1-8 by the first launch, the rest by the relaunch: every loss bitwise the base's.
    rows = _jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, 9)) + list(range(resumed + 1, STEPS + 1))
    for row in rows:
        assert row["loss"] == base[row["step"]]["loss"], row["step"]
        assert row["samples_digest"] == base[row["step"]]["samples_digest"], row["step"]
    assert not glob.glob(os.path.join(memory_dir, "*", "h*", "slot*")), os.listdir(memory_dir)


# -- a whole node lost ---------------------------------------------------------------------


@pytest.fixture
def node_memory_dirs():
    """A private memory directory per simulated node (``CKPT_MEMORY_DIR`` of its agent)."""
    parent = _private_memory_dir()
    yield [os.path.join(parent, f"node{i}") for i in range(2)]
    shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def job_factory(tmp_path):
    jobs: list[ElasticJob] = []

    def make(name: str, trainer_args: list[str], **kwargs) -> ElasticJob:
        job = ElasticJob(workdir=str(tmp_path / name), trainer_args=trainer_args, **kwargs)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()


def _replica_verified(node_dir: str, step: int, rank: int) -> bool:
    """The node holds, in a committed slot of ``step``, rank ``rank``'s shard with the
    crc32c its manifest lists (the replica sent from the other node arrived whole)."""
    name = shard_filename(rank)
    for slot_dir in glob.glob(os.path.join(node_dir, "*", "h*", "slot*")):
        loaded = read_commit(slot_dir)
        if isinstance(loaded, str) or loaded[0].step != step:
            continue
        crc = {entry.path: entry.crc32c for entry in loaded[1].files}[name]
        with open(os.path.join(slot_dir, name), "rb") as fh:
            if crc32c_of(fh.read()) == crc:
                return True
    return False


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lost_node_resumes_from_the_replica_on_the_survivor_at_world_size_1(
    job_factory, node_memory_dirs, backend
):
    # The uninterrupted reference runs at the same time (the loss is timed by the hang
    # below, not by the clock), to keep the scenario near a minute on two cores.
    reference = job_factory("reference", list(TRAINER_ARGS), rdzv_id="mt-reference")
    reference.add_agent()
    reference.add_agent()

    # nnodes 1:2: the survivor may go on alone. Rank 1 stops making progress at the start
    # of step 14, so the node is lost after step 13 exactly. (With 1:2 a first round may
    # close at world size 1 before the second agent joins; torchrun then restarts the
    # group at world size 2 as a membership change, which keeps the restart count 0.)
    job = job_factory(
        "lost",
        [*TRAINER_ARGS, "--set", "checkpoint.memory_every=1"],
        nnodes="1:2",
        rdzv_id="mt-lost",
        env={"TRAINER_FAULTS": f"hang:step={LOST_AFTER + 1}:rank=1"},
        rdzv_backend=backend,
    )
    memory_of = {}  # agent name -> its node's memory dir
    for node_dir in node_memory_dirs:
        memory_of[job.add_agent(env={"CKPT_MEMORY_DIR": node_dir}).name] = node_dir
    job.wait_for(
        lambda: job.last_step() == LOST_AFTER and job.metrics()[-1]["world_size"] == 2,
        150,
        f"step {LOST_AFTER} at world size 2",
    )
    survivor = job.agent_of_rank0(2)
    assert survivor is not None, job.logs_tail()
    (lost,) = [a for a in job.agents if a is not survivor]
    # Rank 1's shard of step 13 reaches the survivor in the background after the snapshot.
    job.wait_for(
        lambda: _replica_verified(memory_of[survivor.name], LOST_AFTER, 1),
        30,
        f"the survivor's replica of rank 1's shard of step {LOST_AFTER}",
    )
    job.kill_node(lost)
    shutil.rmtree(memory_of[lost.name])  # the lost node's host memory is gone with it
    assert job.wait_agents(150, [survivor]) == {survivor.name: 0}, job.logs_tail()
    assert reference.wait_agents(150) == {"agent0": 0, "agent1": 0}, reference.logs_tail()
    ref = {r["step"]: r for r in reference.metrics()}
    assert sorted(ref) == list(range(1, NODE_STEPS + 1))
    assert {r["world_size"] for r in ref.values()} == {2}

    events = job.events()
    resumes = [e for e in events if e["event"] == "resume"]
    assert resumes, events
    last = resumes[-1]
    assert (last["step"], last["tier"], last["old_world_size"], last["new_world_size"]) == (
        LOST_AFTER, "memory", 2, 1
    ), resumes  # fmt: skip
    choice = [e for e in events if e["event"] == "tier_choice"][-1]
    assert (choice["tier"], choice["step"], choice["durable_step"]) == (
        "memory", LOST_AFTER, NODE_EVERY
    ), choice  # fmt: skip
    assert f"memory step {LOST_AFTER} newer than durable {NODE_EVERY}" in choice["reason"]
    assert not [e for e in events if e["event"] in ("fallback", "memory_snapshot_failed")]
    assert not os.path.exists(memory_of[lost.name])  # so rank 1's shard came from the replica

    rows = job.metrics()
    lost_at = max(i for i, r in enumerate(rows) if r["world_size"] == 2)
    assert rows[lost_at]["step"] == LOST_AFTER
    after = rows[lost_at + 1 :]
    assert [r["step"] for r in after] == list(range(LOST_AFTER + 1, NODE_STEPS + 1))
    assert {(r["world_size"], r["restart_count"]) for r in after} == {(1, 1)}
    for row in rows:
        expected = ref[row["step"]]
        assert row["samples_digest"] == expected["samples_digest"], row
        assert abs(row["loss"] - expected["loss"]) <= CROSS_WORLD_LOSS_ATOL, (row, expected)
    before = rows[: lost_at + 1]
    if all(r["world_size"] == 2 for r in before):  # no steps in an early round at world 1
        assert [r["step"] for r in before] == list(range(1, LOST_AFTER + 1))
        for row in before:  # the same world size from the start: bitwise
            assert row["loss"] == ref[row["step"]]["loss"], row
    final = ckpt.find_latest_committed(job.ckpt_dir)
    assert (final.step, final.manifest.world_size) == (NODE_STEPS, 1)
    assert not glob.glob(os.path.join(memory_of[survivor.name], "*", "h*", "slot*"))
