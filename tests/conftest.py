"""Shared pytest fixtures."""

from __future__ import annotations

import itertools
import uuid

import pytest
from gcs_emulator import gcs_emulator, gcs_root  # noqa: F401  (fixtures for every test module)

from ckpt import faults

_counter = itertools.count()


@pytest.fixture
def memory_root() -> str:
    """A unique ``memory://`` checkpoint root for one test."""
    return f"memory://test-{uuid.uuid4().hex[:12]}-{next(_counter)}/run"


@pytest.fixture
def tmp_root(tmp_path) -> str:
    """A unique local checkpoint root (a plain path string) for one test."""
    return str(tmp_path / "ckpts")


@pytest.fixture(params=["memory", "local"])
def any_root(request, tmp_path) -> str:
    """A checkpoint root on each local backend: ``memory://`` and a temp dir."""
    if request.param == "memory":
        return f"memory://test-{uuid.uuid4().hex[:12]}/run"
    return str(tmp_path / "ckpts")


@pytest.fixture(autouse=True)
def _no_leftover_storage_faults():
    """Storage faults installed by a test never leak into the next one."""
    faults.clear()
    yield
    faults.clear()
