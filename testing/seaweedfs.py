"""The SeaweedFS harness of the tests (a production S3 server): :mod:`bench.harness.seaweedfs`
(shipped with ``bench``, whose s3 group starts it from an installed wheel too)."""

from __future__ import annotations

from bench.harness.seaweedfs import (
    SeaweedfsMissing,
    SeaweedServer,
    seaweedfs_in_environ,
    start_seaweedfs,
    weed_binary,
)

__all__ = [
    "SeaweedServer",
    "SeaweedfsMissing",
    "seaweedfs_in_environ",
    "start_seaweedfs",
    "weed_binary",
]
