"""End-to-end: a worker SIGKILLed during the start-up, under real torchrun agents.

Two agents (``--nnodes=2:3``, one worker each) on each rendezvous backend run the trainer;
rank 1 is SIGKILLed at each start-up point of the fault grammar, one per attempt: inside
``init_process_group`` (``kill:at=init_process_group``), while the others build the
checkpoint manager's gloo group (``kill:at=checkpoint_manager``) and at ``resume()``
(``kill:at=resume``). Before any step exists no failure detector used to run: the survivor
waited in ``init_process_group`` (121 s) or ``new_group`` (600 s) for the dead rank while,
on a loaded machine, the other agent's rendezvous timed out and the job ended. Now no
survivor waits longer than the peer timeout + 10 s, and the job finishes equal to the
uninterrupted run bit for bit.
"""

from __future__ import annotations

import datetime
import re

import pytest
from test_elastic_e2e import assert_bitwise_like, assert_completed, run_two_agents

from elastic.heartbeat import DEFAULT_PEER_TIMEOUT_S, STARTUP_GRACE_S
from testing.local_cluster import BACKENDS, ElasticJob
from testing.soak import survivor_waits

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

STARTUP_FAULTS = ";".join([
    # The init_process_group point counts the agent's own restarts (the job-wide count
    # needs the group): it fires for the first rank 1 of each agent, once or twice.
    "kill:at=init_process_group:rank=1:attempt=0",
    "kill:at=checkpoint_manager:rank=1:attempt=1",
    "kill:at=resume:rank=1:attempt=2",
])  # fmt: skip
BOUND_S = DEFAULT_PEER_TIMEOUT_S + STARTUP_GRACE_S
"""The longest a survivor may wait for a rank that died during the start-up."""
_INJECTED = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank \d+\] .*injecting fault (\S+)"
)


def startup_kills(job: ElasticJob) -> list[tuple[float, str, str]]:
    """(time, spec, agent of the victim) of each fault fired, from the workers' log lines."""
    kills = []
    for agent in job.agents:
        for line in agent.log().splitlines():
            m = _INJECTED.match(line)
            if m:
                when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                kills.append((when, m.group(2), agent.name))
    return sorted(kills)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kills_during_the_startup_end_the_survivors_within_the_bound_and_the_job_matches(
    tmp_path, reference_run, backend
):
    job = ElasticJob(
        workdir=str(tmp_path / "startup"),
        trainer_args=list(reference_run.trainer_args),
        rdzv_id="startup",
        rdzv_backend=backend,
        nnodes="2:3",
        max_restarts=6,
        env={"TRAINER_FAULTS": STARTUP_FAULTS},
    )
    try:
        run_two_agents(job, 240)
        assert_completed(job)
        kills = startup_kills(job)
        waits = list(zip([spec for _, spec, _ in kills],
                         survivor_waits(job, [(t, victim) for t, _, victim in kills])))  # fmt: skip
        print(
            f"\n[{backend}] kill -> survivor released (s): {[(s, round(w, 2)) for s, w in waits]}"
        )
        points = {re.search(r"at=(\w+)", spec).group(1) for spec, _ in waits}
        assert points == {"init_process_group", "checkpoint_manager", "resume"}, waits
        assert all(w <= BOUND_S for _, w in waits), (waits, job.logs_tail())
        assert_bitwise_like(reference_run, job)
    finally:
        job.close()
