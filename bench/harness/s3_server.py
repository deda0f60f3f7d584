"""moto's S3 as a local S3 server for tests and benchmarks: a real HTTP server process.

:func:`start_s3_server` runs ``python -m bench.harness.s3_server --port N`` on 127.0.0.1: the
moto server's own WSGI application (``moto[server]`` from the test extra; the same one
``moto_server`` runs), in memory, behind a small middleware that the test process
drives over HTTP (``/_ckpt_test/...``, never forwarded to moto):

- server-side faults: the next N requests matching a method and a substring of
  ``path?query`` are answered with an S3 error (``503 SlowDown``, ``500
  InternalError``, ``400 RequestTimeout``...) in S3's XML, after the request body was
  read, as S3 does: what botocore parses and retries on is then the real wire format;
- a log of the requests served (method, path, query, whether it was a copy), to check
  what a save sent and in which order.

The process is a :class:`bench.harness.server_process.ServerProcess`: ``pause`` (SIGSTOP),
``kill`` and a restart on the same port are outages. Objects live in the server's
memory: a killed server forgets them.

Clients reach it with :func:`s3_env` (botocore reads ``AWS_ENDPOINT_URL``; moto takes
any credentials). Findings behind these choices: docs/s3-server-notes.md. This module
does not import pytest.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import urllib.request
from typing import Any

from bench.harness.server_process import (
    NO_PROXY_OPENER,
    ServerProcess,
    answers_ok,
    environ_for,
    start_server,
)

CONTROL_PREFIX = "/_ckpt_test/"
REGION = "us-east-1"


def s3_env(endpoint: str) -> dict[str, str]:
    """Environment variables that send botocore and s3fs (of this process or a child) to
    ``endpoint`` with moto's test credentials."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }


class S3Store(ServerProcess):
    """An S3 server process this process started (moto here, SeaweedFS in
    :mod:`bench.harness.seaweedfs`): a client and bucket chores for the tests."""

    def client(self) -> Any:
        """A botocore S3 client for this server (test credentials, no retries)."""
        import botocore.session
        from botocore.config import Config

        env = s3_env(self.endpoint)
        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            config=Config(retries={"total_max_attempts": 1}),
        )

    def empty_bucket(self, name: str) -> None:
        """Delete every object and abort every multipart upload in bucket ``name``."""
        client = self.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys})
        for upload in client.list_multipart_uploads(Bucket=name).get("Uploads", []):
            client.abort_multipart_upload(
                Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"]
            )

    def delete_bucket(self, name: str) -> None:
        """Empty bucket ``name``, then delete it (SeaweedFS frees its volumes with it)."""
        self.empty_bucket(name)
        self.client().delete_bucket(Bucket=name)

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (the servers take any credentials)."""
        self.client().create_bucket(Bucket=name)


class S3Server(S3Store):
    """One moto S3 server process this process started, with its fault and log controls."""

    def _control(self, name: str, payload: Any = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(
            f"{self.endpoint}{CONTROL_PREFIX}{name}",
            data=data,
            method="GET" if data is None else "POST",
            headers={"Content-Type": "application/json"},
        )
        with NO_PROXY_OPENER.open(request, timeout=10) as response:
            return json.loads(response.read() or b"null")

    def inject(self, status: int, code: str, where: str, times: int = 1) -> None:
        """Answer the next ``times`` requests matching ``where`` with ``status`` and the S3
        error ``code``: ``"PUT rank_0"`` is a PUT whose ``path?query`` contains ``rank_0``
        (a method alone, or a substring alone, match more)."""
        method, _, match = where.partition(" ") if where[:1].isupper() else ("", "", where)
        self._control(
            "faults",
            {
                "status": status,
                "code": code,
                "times": times,
                "method": method or None,
                "match": match,
            },
        )

    def fired(self) -> int:
        """How many injected errors were served."""
        return int(self._control("fired"))

    def requests(self) -> list[dict[str, Any]]:
        """The requests served so far (``method``, ``path``, ``query``, ``copy``)."""
        return list(self._control("log"))

    def reset(self) -> None:
        """Forget armed faults and the request log."""
        self._control("reset", {})


def start_s3_server(*, port: int | None = None, ready_timeout_s: float = 30.0) -> S3Server:
    """Start a moto S3 server on 127.0.0.1 (a free port, or ``port`` to restart one on
    the same address) and return once it answers."""
    server = start_server(
        lambda chosen: [sys.executable, "-m", "bench.harness.s3_server", "--port", str(chosen)],
        lambda endpoint: answers_ok(f"{endpoint}{CONTROL_PREFIX}log"),
        name="moto-s3",
        port=port,
        ready_timeout_s=ready_timeout_s,
        server_class=S3Server,
    )
    assert isinstance(server, S3Server)
    return server


def s3_in_environ(server: S3Server) -> Any:
    """:func:`s3_env` in ``os.environ`` for the block; the server stopped afterwards."""
    return environ_for(server, s3_env(server.endpoint))


# -- the server process ------------------------------------------------------------------


class _Faults:
    """The middleware: control requests, armed faults, the request log."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.armed: list[dict[str, Any]] = []
        self.log: list[dict[str, Any]] = []
        self.fired = 0

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if path.startswith(CONTROL_PREFIX):
            return self._control(path[len(CONTROL_PREFIX) :], environ, start_response)
        method = environ.get("REQUEST_METHOD", "")
        query = environ.get("QUERY_STRING", "")
        target = f"{path}?{query}"
        with self.lock:
            self.log.append(
                {
                    "method": method,
                    "path": path,
                    "query": query,
                    "copy": "HTTP_X_AMZ_COPY_SOURCE" in environ,
                }
            )
            fault = next(
                (
                    f
                    for f in self.armed
                    if f["times"] > 0 and f["method"] in (None, method) and f["match"] in target
                ),
                None,
            )
            if fault is not None:
                fault["times"] -= 1
                self.fired += 1
        if fault is None:
            return self.app(environ, start_response)
        _drain(environ)
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{fault['code']}</Code><Message>injected by the test</Message>"
            f"<Resource>{path}</Resource><RequestId>ckpt-test</RequestId></Error>"
        ).encode()
        start_response(
            f"{fault['status']} Injected",
            [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
        )
        return [body]

    def _control(self, name: str, environ: dict[str, Any], start_response: Any) -> Any:
        payload = json.loads(_drain(environ) or b"null")
        with self.lock:
            if name == "faults":
                self.armed.append(dict(payload))
                answer: Any = len(self.armed)
            elif name == "fired":
                answer = self.fired
            elif name == "log":
                answer = list(self.log)
            elif name == "reset":
                self.armed.clear()
                self.log.clear()
                self.fired = 0
                answer = True
            else:
                answer = None
        body = json.dumps(answer).encode()
        status = "200 OK" if answer is not None else "404 Not Found"
        start_response(status, [("Content-Type", "application/json")])
        return [body]


def _drain(environ: dict[str, Any]) -> bytes:
    length = int(environ.get("CONTENT_LENGTH") or 0)
    return environ["wsgi.input"].read(length) if length else b""


def main(argv: list[str] | None = None) -> None:
    from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    parser = argparse.ArgumentParser(description="moto S3 on 127.0.0.1 with test controls")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    app = _Faults(DomainDispatcherApplication(create_backend_app))
    run_simple("127.0.0.1", args.port, app, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
