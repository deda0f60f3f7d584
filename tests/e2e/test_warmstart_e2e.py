"""End-to-end: the trainer under real torchrun agents launched through ``-m warmstart``.

Same agents as tests/e2e/test_elastic_e2e.py (``--nnodes=2:4``, one worker each, one
rendezvous), with ``-m warmstart -m trainer`` as the worker command: attempt 0 runs cold
and starts each node's zygote; restarts are forked from it. What a plain restart
guarantees must hold: bitwise the losses of an uninterrupted plain run, the same samples
after a reshard, and no process left behind when a whole node is killed.
"""

from __future__ import annotations

import os
import re
import time

import pytest
from test_elastic_e2e import (
    TRAINER_ARGS,
    assert_bitwise_like,
    assert_completed,
    assert_repeated_steps_saw_same_samples,
    run_two_agents,
)

from testing.local_cluster import BACKENDS, ElasticJob

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WARM = re.compile(r"warm start: worker pid (\d+)")


@pytest.fixture
def jobs(tmp_path):
    made: list[ElasticJob] = []

    def make(name: str, warm: bool = True, **kwargs) -> ElasticJob:
        args = ["-m", "trainer", *TRAINER_ARGS] if warm else list(TRAINER_ARGS)
        job = ElasticJob(
            workdir=str(tmp_path / name),
            trainer_args=args,
            module="warmstart" if warm else "trainer",
            rdzv_id=name,
            **kwargs,
        )
        made.append(job)
        return job

    yield make
    for job in made:
        job.close()


def warm_children(job: ElasticJob, agent) -> list[int]:
    return [int(pid) for pid in WARM.findall(agent.log())]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("backend", BACKENDS)
def test_warm_restarts_match_an_uninterrupted_plain_run(jobs, reference_run, backend):
    job = jobs("warm", rdzv_backend=backend)
    # Two restarts: the second one is warm on both nodes whatever the zygotes' start took.
    job.env["TRAINER_FAULTS"] = "kill:step=9:rank=1:attempt=0;kill:step=17:rank=0:attempt=1"
    run_two_agents(job, 200)
    assert_completed(job)
    rows = job.metrics()
    assert max(r["restart_count"] for r in rows) == 2
    for agent in job.agents:
        assert len(warm_children(job, agent)) >= 1, agent.log()[-3000:]
    assert_bitwise_like(reference_run, job)


def test_killed_warm_node_leaves_nothing_behind_and_survivors_reshard(jobs):
    job = jobs("lost")
    job.env["TRAINER_FAULTS"] = "kill:step=4:rank=1:attempt=0"  # so attempt 1 runs warm
    agents = [job.add_agent() for _ in range(3)]
    job.wait_for(
        lambda: (
            job.last_step() >= 12
            and job.metrics()[-1]["world_size"] == 3
            and job.metrics()[-1]["restart_count"] >= 1
        ),
        180,
        "step 12 at world 3 after a restart",
    )
    victim = agents[2]
    children = warm_children(job, victim)
    assert children, victim.log()[-3000:]
    job.kill_node(victim)  # the agent and its launchers; the zygote must end the children
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in children):
        time.sleep(0.1)
    assert not [p for p in children if _alive(p)], "warm workers outlived their killed node"
    codes = job.wait_agents(180, agents[:2])
    assert codes == {"agent0": 0, "agent1": 0}, job.logs_tail()
    assert_completed(job)
    rows = job.metrics()
    assert rows[-1]["world_size"] == 2
    assert assert_repeated_steps_saw_same_samples(rows) >= 1
    assert os.path.isdir(job.ckpt_dir)
