"""S3 metrics on SeaweedFS (bench/harness/seaweedfs.py), measured in the same rounds:

- ``s3_save_vs_put``: ``ckpt.save`` to ``s3://`` vs one botocore ``PutObject`` per rank
  of as many bytes (the client's defaults: what one upload of the same bytes costs);
- ``s3_load_vs_get``: a cold ``ckpt.load`` of that checkpoint vs one ``GetObject`` per
  rank of the object ``PutObject`` wrote.

``bench.__main__`` starts the server with :func:`bench.harness.seaweedfs.start_seaweedfs` (the
starter the tests use) and puts its endpoint and test credentials into ``os.environ``
before the ranks are spawned (they inherit them).
"""

from __future__ import annotations

from typing import Any

from bench.object_store import store_rounds


def s3_rounds(rank: int, world: int, bucket: str, width: int, rounds: int) -> dict[str, Any]:
    """Rounds of {save, put, forced multipart} then {load, get} on ``s3://bucket``."""
    return store_rounds(rank, world, "s3", bucket, width, rounds)
