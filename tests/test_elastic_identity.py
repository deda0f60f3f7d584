"""RunIdentity: reading what torchrun puts in the environment."""

from __future__ import annotations

import os
import socket

import pytest

from elastic.identity import LOCAL_RUN_ID, RunIdentity, job_restart_count

TORCHRUN_ENV = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "TORCHELASTIC_RESTART_COUNT": "2",
    "TORCHELASTIC_MAX_RESTARTS": "3",
    "TORCHELASTIC_RUN_ID": "job1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


@pytest.mark.timeout(30)
def test_single_process_defaults_without_torchrun() -> None:
    identity = RunIdentity.from_env({})
    assert (identity.rank, identity.world_size) == (0, 1)
    assert (identity.local_rank, identity.local_world_size, identity.group_rank) == (0, 1, 0)
    assert (identity.restart_count, identity.max_restarts) == (0, 0)
    assert identity.run_id == LOCAL_RUN_ID == "local"
    assert identity.master_addr is None and identity.master_port is None
    assert not identity.is_torchrun
    assert identity.is_coordinator
    assert identity.pid == os.getpid()
    assert identity.hostname == socket.gethostname()


@pytest.mark.timeout(30)
def test_reads_every_torchrun_variable() -> None:
    identity = RunIdentity.from_env(TORCHRUN_ENV)
    assert identity.rank == 3
    assert identity.local_rank == 1
    assert identity.world_size == 4
    assert identity.local_world_size == 2
    assert identity.group_rank == 1
    assert identity.restart_count == 2
    assert identity.max_restarts == 3
    assert identity.run_id == "job1"
    assert identity.master_addr == "10.0.0.1"
    assert identity.master_port == 29500
    assert identity.is_torchrun
    assert not identity.is_coordinator


@pytest.mark.timeout(30)
def test_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    assert RunIdentity.from_env().rank == 3


@pytest.mark.timeout(30)
def test_identity_is_frozen() -> None:
    identity = RunIdentity.from_env({})
    with pytest.raises(AttributeError):
        identity.rank = 5  # type: ignore[misc]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"RANK": "x"}, "RANK"),
        ({"RANK": "-1"}, "RANK"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE"),
        ({"RANK": "4"}, "RANK"),
        ({"LOCAL_RANK": "1.5"}, "LOCAL_RANK"),
        ({"LOCAL_RANK": "2"}, "LOCAL_RANK"),
        ({"LOCAL_WORLD_SIZE": "?"}, "LOCAL_WORLD_SIZE"),
        ({"GROUP_RANK": "a"}, "GROUP_RANK"),
        ({"TORCHELASTIC_RESTART_COUNT": "-2"}, "TORCHELASTIC_RESTART_COUNT"),
        ({"TORCHELASTIC_MAX_RESTARTS": "many"}, "TORCHELASTIC_MAX_RESTARTS"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT"),
    ],
)
def test_malformed_values_name_the_variable(overrides: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        RunIdentity.from_env({**TORCHRUN_ENV, **overrides})


@pytest.mark.timeout(30)
def test_job_restart_count_without_process_group_is_local() -> None:
    identity = RunIdentity.from_env({"TORCHELASTIC_RESTART_COUNT": "4"})
    assert job_restart_count(identity) == 4


@pytest.mark.parametrize(
    ("env", "warns"),
    [
        ({}, False),  # not under torchrun
        ({"TORCHELASTIC_MAX_RESTARTS": "0"}, False),  # no restarts, nothing to reuse
        ({"TORCHELASTIC_MAX_RESTARTS": "3"}, True),
        ({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, False),
        ({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}, True),
        # --rdzv_backend=ft (or any handler whose use_agent_store is False): nothing shared
        ({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "False"}, False),
        ({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}, True),
    ],
)
def test_restart_setup_problem_names_the_variable_to_set(env, warns):
    from elastic.identity import restart_setup_problem

    problem = restart_setup_problem(env)
    assert (problem is not None) == warns
    if warns:
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in problem
