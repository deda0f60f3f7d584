"""The S3 server harness of the tests (moto in server mode): :mod:`bench.harness.s3_server`
(shipped with ``bench``, whose s3 group starts it from an installed wheel too)."""

from __future__ import annotations

from bench.harness.s3_server import (
    CONTROL_PREFIX,
    REGION,
    S3Server,
    main,
    s3_env,
    s3_in_environ,
    start_s3_server,
)

__all__ = [
    "CONTROL_PREFIX",
    "REGION",
    "S3Server",
    "main",
    "s3_env",
    "s3_in_environ",
    "start_s3_server",
]
