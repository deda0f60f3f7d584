"""Checkpoint round trip on 2 local processes: save sharded state, damage the newest
checkpoint, and show that load falls back to the previous committed one.

    python examples/ckpt_roundtrip.py [--root DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ckpt


def worker(rank: int, world: int, root: str, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    for step in (10, 20):
        for p in model.parameters():
            p.data.add_(1.0)
        ckpt.save(
            {"model": model.state_dict(), "step": step}, root, step, metadata={"note": "demo"}
        )
    dist.barrier()
    if rank == 0:  # flip one byte in the newest checkpoint's shard of rank 1
        path = os.path.join(root, "checkpoint_0000020", "rank_00001.distcp")
        with open(path, "rb") as f:
            data = bytearray(f.read())
        data[len(data) // 2] ^= 1
        with open(path, "wb") as f:
            f.write(bytes(data))
    dist.barrier()
    state = {"model": model.state_dict(), "step": -1}
    result = ckpt.load(state, root)
    if rank == 0:
        print(
            f"loaded step {result.step} from {result.url}; skipped: "
            + "; ".join(f"step {s.step} ({s.reason[:90]}...)" for s in result.skipped)
        )
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="checkpoint root (default: a temp dir)")
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="ckpt-demo-")
    init_file = tempfile.mktemp(prefix="pg-")
    mp.spawn(worker, args=(2, root, init_file), nprocs=2, join=True)
    os.system(f"{sys.executable} -m ckpt ls {root}")
    return os.system(f"{sys.executable} -m ckpt verify {root}/checkpoint_0000010") >> 8


if __name__ == "__main__":
    sys.exit(main())
