"""The GCS emulator fixture works, and gcsfs on it behaves as the checkpoint code assumes.

Each test pins one fact from docs/gcs-emulator-notes.md. gcsfs is imported inside the
tests (after the ``gcs_emulator`` fixture set GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false).
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time

import google_crc32c
import pytest

from testing.gcs_emulator import (
    EMULATOR_HOST_ENV,
    ZB_HNS_ENV,
    Emulator,
    emulator_env,
    gcs_filesystem,
    start_emulator,
)

pytestmark = pytest.mark.gcs


def crc32c_b64(data: bytes) -> str:
    """crc32c as GCS reports it: base64 of the 4-byte big-endian checksum."""
    value = google_crc32c.value(data)
    return base64.b64encode(value.to_bytes(4, "big")).decode()


def strip_gs(url: str) -> str:
    assert url.startswith("gs://"), url
    return url[len("gs://") :]


@pytest.mark.timeout(20)
def test_fixture_sets_environment_and_emulator_answers(gcs_emulator: Emulator) -> None:
    assert gcs_emulator.endpoint == f"http://127.0.0.1:{gcs_emulator.port}"
    assert gcs_emulator.is_running()
    assert os.environ[EMULATOR_HOST_ENV] == gcs_emulator.endpoint
    assert os.environ[ZB_HNS_ENV] == "false"
    assert emulator_env(gcs_emulator.endpoint) == {
        EMULATOR_HOST_ENV: gcs_emulator.endpoint,
        ZB_HNS_ENV: "false",
    }
    import gcsfs
    import gcsfs.core

    # The plain class: the experimental one probes each bucket for ~60 s on the emulator.
    assert gcsfs.GCSFileSystem is gcsfs.core.GCSFileSystem


@pytest.mark.timeout(20)
def test_gcs_root_is_an_empty_fresh_bucket(gcs_root: str) -> None:
    fs = gcs_filesystem()
    bucket, prefix = strip_gs(gcs_root).split("/", 1)
    assert bucket.startswith("test-") and prefix
    assert fs.exists(bucket)
    assert fs.ls(bucket) == []
    assert not fs.exists(strip_gs(gcs_root))


@pytest.mark.timeout(20)
def test_info_reports_size_and_gcs_crc32c(gcs_root: str) -> None:
    fs = gcs_filesystem()
    data = os.urandom(1_048_576 + 13)
    path = f"{strip_gs(gcs_root)}/shard.bin"
    fs.pipe_file(path, data)
    info = fs.info(path)
    assert info["size"] == len(data)
    assert info["crc32c"] == crc32c_b64(data)
    assert base64.b64decode(info["crc32c"]) == google_crc32c.Checksum(data).digest()
    # The empty object's checksum is the crc32c of no bytes, not a missing field.
    fs.pipe_file(f"{path}.empty", b"")
    assert fs.info(f"{path}.empty")["crc32c"] == crc32c_b64(b"") == "AAAAAA=="


@pytest.mark.timeout(20)
def test_cat_file_byte_ranges(gcs_root: str) -> None:
    fs = gcs_filesystem()
    data = bytes(range(256)) * 64
    path = f"{strip_gs(gcs_root)}/ranges.bin"
    fs.pipe_file(path, data)
    for start, end in [(0, 1), (5, 300), (4000, len(data)), (len(data) - 7, None)]:
        assert fs.cat_file(path, start, end) == data[start:end], (start, end)
    assert fs.cat_file(path, -10, None) == data[-10:]
    # An end past the object is clamped, as with Python slices.
    assert fs.cat_file(path, len(data) - 3, len(data) + 1000) == data[-3:]


@pytest.mark.timeout(20)
def test_streamed_write_is_visible_only_after_close(gcs_root: str) -> None:
    fs = gcs_filesystem()
    path = f"{strip_gs(gcs_root)}/stream.bin"
    data = os.urandom(6 * 2**20 + 5)  # over gcsfs's 5 MiB block: a resumable upload
    with fs.open(path, "wb") as out:
        out.write(data[: 3 * 2**20])
        out.flush()
        out.write(data[3 * 2**20 :])
        out.flush()
        fs.invalidate_cache()
        assert not fs.exists(path)  # no partial object: it appears whole, at close
    fs.invalidate_cache()
    assert fs.cat_file(path) == data
    assert fs.info(path)["crc32c"] == crc32c_b64(data)


@pytest.mark.timeout(20)
def test_missing_bucket_and_object_raise_file_not_found_without_retries(gcs_root: str) -> None:
    fs = gcs_filesystem()
    missing_bucket = "no-such-bucket-for-this-test"
    started = time.monotonic()
    with pytest.raises(FileNotFoundError):
        fs.pipe_file(f"{missing_bucket}/x", b"1")
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{missing_bucket}/x")
    with pytest.raises(FileNotFoundError):
        fs.info(f"{missing_bucket}/x")
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{strip_gs(gcs_root)}/absent")
    assert not fs.exists(f"{missing_bucket}/x")
    # gcsfs does not retry 404 (its retries of 5xx/429 take ~30 s).
    assert time.monotonic() - started < 5.0


_RANGE_READER = """
import sys, google_crc32c, gcsfs
assert gcsfs.GCSFileSystem is gcsfs.core.GCSFileSystem
fs = gcsfs.GCSFileSystem(token="anon", requests_timeout=20)
path, size, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
crc = google_crc32c.Checksum()
for start in range(0, size, chunk):
    crc.update(fs.cat_file(path, start, min(start + chunk, size)))
print(crc.digest().hex())
"""


@pytest.mark.timeout(45)
def test_two_processes_read_concurrently_with_explicit_ranges(
    gcs_emulator: Emulator, gcs_root: str
) -> None:
    fs = gcs_filesystem()
    data = os.urandom(24 * 2**20 + 3)
    path = f"{strip_gs(gcs_root)}/shared.bin"
    fs.pipe_file(path, data)
    env = {**os.environ, **emulator_env(gcs_emulator.endpoint)}
    argv = [sys.executable, "-c", _RANGE_READER, path, str(len(data)), str(4 * 2**20 + 1)]
    readers = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    try:
        outputs = [reader.communicate(timeout=30) for reader in readers]
    finally:
        for reader in readers:
            if reader.poll() is None:
                reader.kill()
                reader.wait(timeout=5)
    expected = google_crc32c.Checksum(data).digest().hex()
    for reader, (stdout, stderr) in zip(readers, outputs):
        assert reader.returncode == 0, stderr.decode(errors="replace")[-2000:]
        assert stdout.decode().strip() == expected


@pytest.mark.timeout(20)
def test_paused_emulator_hits_request_timeout_which_gcsfs_does_not_retry(
    gcs_emulator: Emulator,
) -> None:
    import fsspec.exceptions

    own = start_emulator()
    try:
        os.environ[EMULATOR_HOST_ENV] = own.endpoint  # read by gcsfs on every request
        fs = gcs_filesystem(requests_timeout=1)
        fs.mkdir("hung")
        fs.pipe_file("hung/x", b"1")
        own.pause()
        started = time.monotonic()
        with pytest.raises(fsspec.exceptions.FSTimeoutError):
            fs.cat_file("hung/x")
        assert time.monotonic() - started < 4.0  # one attempt: a timeout is not retried
    finally:
        os.environ[EMULATOR_HOST_ENV] = gcs_emulator.endpoint
        own.stop()
    assert not own.is_running()


@pytest.mark.timeout(30)
def test_filesystem_backend_keeps_objects_across_restart(gcs_emulator: Emulator, tmp_path) -> None:
    data_dir = str(tmp_path / "gcs-data")
    first = start_emulator(data_dir)
    port = first.port
    try:
        os.environ[EMULATOR_HOST_ENV] = first.endpoint
        fs = gcs_filesystem()
        fs.mkdir("persist")
        fs.pipe_file("persist/a/b", b"kept")
        first.kill()
        assert not first.is_running()
        second = start_emulator(data_dir, port=port)
        try:
            assert fs.cat_file("persist/a/b") == b"kept"
        finally:
            second.stop()
    finally:
        os.environ[EMULATOR_HOST_ENV] = gcs_emulator.endpoint
        first.stop()
