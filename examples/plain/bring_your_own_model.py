"""examples/bring_your_own_model.py before it was made fault-tolerant: a plain FSDP2 step loop.

The step loop as PyTorch users write it (``DistributedSampler`` with ``set_epoch`` behind
an endless iterator, gradient accumulation over micro-batches), kept to measure what the
conversion changes (README, "Bring your own model"; ``tests/test_adoption_diffs.py``).
Runs under torchrun; a crash loses the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler

logger = logging.getLogger("byom")


# -- the user's own model and data -------------------------------------------------------------


class SyntheticClassification(Dataset):
    """``n`` samples of ``features`` floats; sample ``i`` comes from a generator seeded with ``i``.

    The label is the argmax of a fixed random projection of the input, so it can be learned.
    """

    def __init__(self, n: int = 2048, features: int = 16, classes: int = 8) -> None:
        self.n, self.features = n, features
        self.projection = torch.randn(
            features, classes, generator=torch.Generator().manual_seed(1234)
        )

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.features, generator=torch.Generator().manual_seed(int(i)))
        return x, (x @ self.projection).argmax()


class MLP(nn.Module):
    """Three linear layers with GELU and dropout (its masks come from ``elastic.sample_rng``)."""

    def __init__(
        self, features: int = 16, hidden: int = 64, classes: int = 8, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Dropout(dropout)),
                nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(dropout)),
            ]
        )
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(seed: int, device: torch.device) -> nn.Module:
    """The same initial weights on every rank, then sharded with FSDP2."""
    torch.manual_seed(seed)
    model = MLP().to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


# -- setup ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a small MLP with FSDP2.")
    add = parser.add_argument
    add("--run-dir", required=True, help="where metrics.jsonl is appended")
    add("--max-steps", type=int, default=20, help="train up to this step (default 20)")
    add("--global-batch", type=int, default=32, help="samples per step, all ranks (default 32)")
    add("--micro-batch", type=int, default=8,
        help="samples per forward (default 8), gradients accumulated over global-batch / "
        "(world size * micro-batch) of them")  # fmt: skip
    add("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    add("--warmup-steps", type=int, default=4, help="linear warmup steps (default 4)")
    add("--decay-steps", type=int, default=100,
        help="cosine decay steps after the warmup (default 100)")  # fmt: skip
    add("--seed", type=int, default=0, help="model init, data order and RNG seed (default 0)")
    add("--num-workers", type=int, default=0,
        help="DataLoader worker processes (default 0: batches built in the training process)")  # fmt: skip
    return parser.parse_args(argv)


def endless(loader: DataLoader, sampler: DistributedSampler) -> Iterator:
    """The loader's batches, epoch after epoch (a step loop does not care where epochs end)."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def train_step(model, opt, sched, x, y, micro_batch: int) -> float:
    """One optimizer step over this rank's batch in micro-batches; returns the mean loss."""
    losses = []
    chunks = range(0, len(x), micro_batch)
    for k, first in enumerate(chunks):
        model.set_requires_gradient_sync(k == len(chunks) - 1)  # reduce after the last
        rows = slice(first, first + micro_batch)
        loss = F.cross_entropy(model(x[rows]), y[rows])
        (loss / len(chunks)).backward()
        losses.append(loss.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    total = torch.stack(losses).mean()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = SyntheticClassification()
    model = build_model(args.seed, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=args.warmup_steps),
            torch.optim.lr_scheduler.CosineAnnealingLR(
                opt, T_max=args.decay_steps, eta_min=args.lr / 10
            ),
        ],
        milestones=[args.warmup_steps],
    )
    os.makedirs(args.run_dir, exist_ok=True)
    log = open(os.path.join(args.run_dir, "metrics.jsonl"), "a") if rank == 0 else None  # noqa: SIM115
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=args.num_workers)  # fmt: skip
    batches = endless(loader, sampler)
    for step in range(1, args.max_steps + 1):
        started = time.perf_counter()
        x, y = (t.to(device) for t in next(batches))
        loss = train_step(model, opt, sched, x, y, args.micro_batch)
        if log is not None:
            log.write(json.dumps({
                "step": step, "loss": loss, "world_size": world, "lr": sched.get_last_lr()[0],
                "step_time_s": time.perf_counter() - started,
            }) + "\n")  # fmt: skip
    if log is not None:
        log.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
    if torch.cuda.is_available():  # cuBLAS needs this for deterministic matmuls
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    device = torch.device("cpu")
    try:
        train(args, device)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        logger.info("done: %d steps", args.max_steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
