"""Fixtures shared by the e2e files."""

from __future__ import annotations

import pytest
from test_elastic_e2e import TRAINER_ARGS, run_two_agents

from testing.local_cluster import ElasticJob


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """One uninterrupted 2-agent run of the e2e trainer arguments (``TRAINER_ARGS``), made
    once per session for every test that compares a faulted run with it bit for bit. On
    the ``ft`` backend: the rendezvous backend and ``--nnodes`` range do not change the
    numbers (each test's own faulted run uses its own backend)."""
    job = ElasticJob(
        workdir=str(tmp_path_factory.mktemp("reference")),
        trainer_args=list(TRAINER_ARGS),
        rdzv_backend="ft",
        nnodes="2:3",
    )
    try:
        run_two_agents(job, 150)
        yield job
    finally:
        job.close()
