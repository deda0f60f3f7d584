"""A user's DDP script with its own ``DataLoader`` worker processes, public API only.

What a user converting a plain DDP script writes: ``dist.init_process_group`` itself (not
``elastic.init_distributed``), a ``DataLoader`` of its own (``num_workers``, persistent or
not, ``fork`` or ``spawn`` workers) over an ``elastic.ElasticSampler``, a
``ckpt.CheckpointManager`` and an ``elastic.RunGuard`` around the loop. Rank 0 appends
``{"step", "loss", "restart_count", "samples_digest"}`` per step to ``RUN_DIR/metrics.jsonl``
(``elastic.RunRecorder``); a rank stopped by SIGTERM writes ``{"code", "step"}`` to
``RUN_DIR/exit.rank{R}.json`` before it exits with that code (143). With ``--step-sleep``
each step also sleeps that long, so a test can signal the job in the middle of a run.

    torchrun --nproc_per_node=2 tests/e2e/scripts/ddp_loader.py --ckpt-dir C --run-dir R \\
        --max-steps 40 --num-workers 2 --start-method spawn
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

import ckpt
import elastic

GLOBAL_BATCH = 16
SEED = 0


class Numbers(Dataset):
    """Sample ``i``: 8 floats from a generator seeded with ``i``, labelled by their sign sum."""

    def __len__(self) -> int:
        return 512

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, generator=torch.Generator().manual_seed(int(i)))
        return x, (x.sum() > 0).long()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--start-method", default="fork", choices=["fork", "spawn"])
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--fault", action="append", default=[])
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset = Numbers()
    sampler = elastic.ElasticSampler(len(dataset), GLOBAL_BATCH, seed=SEED)
    loader = DataLoader(
        dataset,
        batch_size=sampler.local_batch,
        sampler=sampler,
        num_workers=args.num_workers,
        persistent_workers=args.persistent and args.num_workers > 0,
        multiprocessing_context=args.start_method if args.num_workers else None,
    )
    log = elastic.RunRecorder(args.run_dir, rank)
    manager = ckpt.CheckpointManager(
        args.ckpt_dir, {"model": model, "optim": opt, "sampler": sampler},
        every=args.ckpt_every, on_event=log.event,
    )  # fmt: skip
    code = 0
    try:
        with (
            log,
            manager,
            elastic.RunGuard(saver=manager, faults=args.fault, on_event=log.event) as guard,
        ):
            start = manager.resume() or 0
            batches = iter(loader)
            for step in guard.steps(start, args.max_steps):
                x, y = next(batches)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total = loss.detach().clone()
                dist.all_reduce(total)
                digest = elastic.samples_digest(sampler.global_batch_ids())
                sampler.advance()
                log.metrics({
                    "step": step, "loss": total.item(), "restart_count": guard.attempt,
                    "samples_digest": digest,
                })  # fmt: skip
                manager.maybe_save(step, final=step == args.max_steps)
                if args.step_sleep:
                    time.sleep(args.step_sleep)
    except elastic.Preempted as exc:  # SIGTERM: after the emergency save, exit 143
        code = exc.exit_code
        with open(os.path.join(args.run_dir, f"exit.rank{rank}.json"), "a") as fh:
            fh.write(json.dumps({"code": code, "step": exc.step}) + "\n")
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    elastic.exit_now(main())
