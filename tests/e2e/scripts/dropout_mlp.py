"""A user's FSDP2 MLP with dropout that resumes on another world size, public API only.

Each step's global batch (12 samples) is cut into micro-batches of 2 samples, gradients
accumulated over ``12 / (2 * world_size)`` of them. With ``MODE=scoped`` each
micro-batch's forward and backward run inside ``mb.rng(seed)`` (``elastic.sample_rng``),
so its dropout masks depend on its global sample positions only; with ``MODE=plain``
dropout draws from the process RNG, which ``ckpt`` re-derives per rank on another world
size. Rank 0 appends ``{"step", "loss", "world_size"}`` per step to
``RUN_DIR/losses.jsonl``.

    torchrun --nproc_per_node=N tests/e2e/scripts/dropout_mlp.py CKPT RUN_DIR MAX_STEPS MODE
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

import ckpt
import elastic

GLOBAL_BATCH = 12
MICRO_BATCH = 2
SEED = 0


def build_model() -> nn.Module:
    torch.manual_seed(SEED)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.3),
        nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.3),
        nn.Linear(32, 4),
    )  # fmt: skip
    for i in (0, 3):
        fully_shard(model[i])
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The loss is divided by the global batch already: SUM-reduce the gradients, so
            # the update is the same at every world size (forced: gloo has no PREMUL_SUM).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def main() -> int:
    root, run_dir, max_steps, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if mode not in ("scoped", "plain"):
        raise SystemExit(f"MODE must be 'scoped' or 'plain', got {mode!r}")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    inputs = torch.randn(240, 16, generator=torch.Generator().manual_seed(1))
    labels = (inputs @ torch.randn(16, 4, generator=torch.Generator().manual_seed(2))).argmax(1)
    sampler = elastic.ElasticSampler(len(inputs), GLOBAL_BATCH, seed=3)
    state = {"model": model, "optim": opt, "sampler": sampler}
    manager = ckpt.CheckpointManager(root, state, every=10, seed=SEED)
    os.makedirs(run_dir, exist_ok=True)
    with manager, elastic.RunGuard(saver=manager) as guard:
        start = manager.resume() or 0
        for step in guard.steps(start, max_steps):
            ids = torch.as_tensor(sampler.local_batch_ids())
            x, y = inputs[ids], labels[ids]
            micro_batches = sampler.micro_batches(MICRO_BATCH)
            loss_sum = torch.zeros(())
            for k, mb in enumerate(micro_batches):
                model.set_requires_gradient_sync(k == len(micro_batches) - 1)
                scope = mb.rng(SEED) if mode == "scoped" else contextlib.nullcontext()
                with scope:
                    loss = F.cross_entropy(model(x[mb.local]), y[mb.local], reduction="sum")
                    (loss / GLOBAL_BATCH).backward()
                loss_sum += loss.detach()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sampler.advance()
            dist.all_reduce(loss_sum)
            if rank == 0:
                row = {"step": step, "loss": loss_sum.item() / GLOBAL_BATCH, "world_size": world}
                with open(os.path.join(run_dir, "losses.jsonl"), "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(row) + "\n")
            manager.maybe_save(step, final=step == max_steps)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    elastic.exit_now(main())
