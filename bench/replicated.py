"""Replicated state read once (``ckpt/loading/read_once.py``): DDP's load on SeaweedFS.

Four ranks hold the same state (DDP: every rank a full replica), saved once; each round
loads it cold on every rank twice, in alternating order: with ``read_once`` (each item
read by one rank, broadcast to the others over gloo) and without (every rank reads it
all, as a load did before). Measured:

- ``read_amplification``: storage bytes read by all ranks together over the checkpoint's
  bytes (every file of its manifest), with ``read_once`` (the default on object stores);
- ``read_once_load_vs_each``: the load's time with ``read_once`` over without.

``bench.__main__`` starts SeaweedFS (:func:`bench.harness.seaweedfs.start_seaweedfs`) and
puts its endpoint into the environment the ranks inherit.
"""

from __future__ import annotations

import time
from typing import Any

RANKS = 4
TENSOR_BYTES = 4 << 20


def replicated_state(total_bytes: int) -> dict[str, Any]:
    """``total_bytes`` of float32 tensors, the same on every rank (one seed)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    count = max(1, total_bytes // TENSOR_BYTES)
    return {
        "model": {
            f"layer{i}.weight": torch.randn(TENSOR_BYTES // 4, generator=gen) for i in range(count)
        },
        "step": torch.tensor(1),
    }


def replicated_rounds(
    rank: int, world: int, bucket: str, total_bytes: int, rounds: int
) -> dict[str, Any]:
    """Save once, then rounds of {load read once, load read by each}; raw samples."""
    import torch
    import torch.distributed as dist

    import ckpt
    from bench.rounds import dist_all_gather
    from ckpt.storage import StorageOptions

    root = f"s3://{bucket}/replicated"
    state = replicated_state(total_bytes)
    ckpt.save(state, root, 1)
    checkpoint_bytes = sum(f.size for f in ckpt.find_latest_committed(root).manifest.files)
    target = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "step": torch.tensor(0),
    }
    samples: dict[str, list[Any]] = {"once_s": [], "each_s": [], "once_bytes": [], "each_bytes": []}

    def load(kind: str) -> None:
        options = StorageOptions(read_once=kind == "once")
        dist.barrier()
        t0 = time.perf_counter()
        result = ckpt.load(target, root, storage_options=options)
        dist.barrier()
        samples[f"{kind}_s"].append(time.perf_counter() - t0)
        samples[f"{kind}_bytes"].append(sum(dist_all_gather(int(result.bytes_read))))
        assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())

    for i in range(rounds + 1):  # round 0: warm-up
        for kind in ("once", "each") if i % 2 == 0 else ("each", "once"):
            load(kind)
    ckpt.close()
    return {**samples, "checkpoint_bytes": checkpoint_bytes, "ranks": world}
