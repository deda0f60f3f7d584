"""A user's FSDP2 CNN with BatchNorm and dropout, fault-tolerant through the public API only.

Every rank normalizes its own micro-batches, so BatchNorm's running statistics differ
between ranks; dropout draws from each rank's RNG. At the end each rank writes every
tensor it holds (local parameter shards, buffers, optimizer state) to
``RUN_DIR/state.rank{R}.pt`` for the e2e test to compare bitwise.

    torchrun --nproc_per_node=2 tests/e2e/scripts/cnn_batchnorm.py CKPT RUN_DIR MAX_STEPS [FAULT]
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import ckpt
import elastic


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def main() -> int:
    root, run_dir, max_steps, faults = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.25),
        nn.Flatten(), nn.Linear(4 * 8 * 8, 5),
    )  # fmt: skip
    for i in (0, 5):
        fully_shard(model[i])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    images = torch.randn(256, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 5, (256,), generator=torch.Generator().manual_seed(2))
    sampler = elastic.ElasticSampler(256, 16, seed=3)
    manager = ckpt.CheckpointManager(
        root, {"model": model, "optim": opt, "sampler": sampler}, every=4
    )
    with manager, elastic.RunGuard(saver=manager, faults=faults) as guard:
        start = manager.resume() or 0
        for step in guard.steps(start, max_steps):
            ids = torch.as_tensor(sampler.local_batch_ids())
            loss = nn.functional.cross_entropy(model(images[ids]), labels[ids])
            loss.backward()
            opt.step()
            opt.zero_grad()
            sampler.advance()
            manager.maybe_save(step, final=step == max_steps)
    held = {f"model.{k}": local(v) for k, v in model.state_dict().items()}
    for i, state in enumerate(opt.state.values()):
        held.update({f"optim.{i}.{k}": local(v) for k, v in state.items()})
    os.makedirs(run_dir, exist_ok=True)
    torch.save(held, os.path.join(run_dir, f"state.rank{rank}.pt"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    elastic.exit_now(main())
