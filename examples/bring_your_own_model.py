"""Bring your own model: a plain FSDP2 script made fault-tolerant with `ckpt` and `elastic`.

A small MLP classifier on a synthetic dataset; nothing here comes from the trainer. The
fault-tolerance part is marked ``[ft]`` in ``train()`` and ``train_step()`` (a dozen lines):
a ``ckpt.CheckpointManager`` for the state, an ``elastic.ElasticSampler`` for the data
position, an ``elastic.RunGuard`` around the loop, an RNG scope around each micro-batch.
What that buys:

- a crash (a killed rank, a lost node) restarted by torchrun resumes from the newest
  committed checkpoint; at the same world size the run continues bitwise identically;
- a resume on another world size continues with the same samples, in the same order,
  and the same dropout masks (the gradient of a step does not depend on the world size,
  see ``train_step``: micro-batches of ``--micro-batch`` samples, each in its own
  ``elastic.sample_rng`` scope keyed by its global sample position);
- SIGTERM (preemption) stops at a step boundary, commits an emergency checkpoint when it
  fits the grace period and exits 143.

Run it on 2 CPU ranks, kill rank 1 at step 9, and let torchrun restart the group::

    torchrun --rdzv_backend=ft --rdzv_endpoint=127.0.0.1:0 --nnodes=1 --nproc_per_node=2 \\
        --max_restarts=1 examples/bring_your_own_model.py \\
        --ckpt-dir runs/byom/ckpt --run-dir runs/byom/run --fault kill:step=9:rank=1

(``--rdzv_backend=ft``: this project's rendezvous backend, registered at install; with
torchrun's ``--standalone`` instead, set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.)

or as one plain process (a 1-rank gloo group): ``python examples/bring_your_own_model.py
--ckpt-dir ... --run-dir ...``. ``python -m trainer report runs/byom/run`` summarizes a run.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import Dataset

import ckpt
import elastic

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
    """The same initial weights on every rank and world size, then sharded with FSDP2."""
    torch.manual_seed(seed)
    model = MLP().to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The loss is already divided by the global batch: reduce gradients by SUM, so the
            # update is the same at every world size (forced, since gloo has no PREMUL_SUM).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


# -- setup ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a small MLP with FSDP2, fault-tolerant through the public ckpt and "
        "elastic API. Launch with torchrun (any --nproc_per_node dividing --global-batch; "
        "--rdzv_backend=ft, or with c10d/--standalone set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
        "when torchrun may restart the group) or as one "
        "plain process. Run again with the same --ckpt-dir to resume, on any world size; keep "
        "--global-batch, --seed and the LR schedule flags the same across relaunches.",
        epilog="Outputs: RUN_DIR/metrics.jsonl (one row per step), RUN_DIR/events*.jsonl. Exit "
        "codes: 0 done; 143 stopped by SIGTERM (after an emergency checkpoint when it fits the "
        "grace period); run again to resume.",
    )
    add = parser.add_argument
    add("--ckpt-dir", required=True, help="checkpoint root: a local path or gs://bucket/prefix")
    add("--run-dir", required=True, help="where metrics.jsonl and events*.jsonl are appended")
    add("--max-steps", type=int, default=20, help="train up to this step (default 20)")
    add("--ckpt-every", type=int, default=4, help="save every N steps, 0: at the end (default 4)")
    add("--async-save", action="store_true", help="commit periodic saves in the background")
    add("--memory-every", type=int, default=0, metavar="K",
        help="also snapshot the state every K steps into node memory (the checkpoint manager's "
        "memory tier, under CKPT_MEMORY_DIR or /dev/shm), so a restart resumes from a step "
        "newer than the last --ckpt-every checkpoint; 0: off (default)")  # fmt: skip
    add("--fault", action="append", default=[], metavar="SPEC",
        help="inject a fault (repeatable): KIND:step=S[:rank=R][:attempt=A], KIND one of kill, "
        "exit, raise, hang, sigterm, ckpt-storage, e.g. kill:step=9:rank=1, sigterm:step=5, "
        "ckpt-storage:step=4:rank=1; it fires in restart attempt A only (default 0)")  # fmt: skip
    add("--global-batch", type=int, default=32, help="samples per step, all ranks (default 32)")
    add("--micro-batch", type=int, default=8,
        help="samples per forward (default 8), gradients accumulated over global-batch / "
        "(world size * micro-batch) of them; dropout masks are drawn per micro-batch, so keep "
        "it the same on every world size you resume on")  # fmt: skip
    add("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    add("--warmup-steps", type=int, default=4, help="linear warmup steps (default 4)")
    add("--decay-steps", type=int, default=100,
        help="cosine decay steps after the warmup (default 100); not tied to --max-steps, so "
        "a finished run can be extended by running it again with a larger --max-steps")  # fmt: skip
    add("--seed", type=int, default=0, help="model init, data order and RNG seed (default 0)")
    add("--num-workers", type=int, default=0,
        help="DataLoader worker processes (default 0: batches built in the training process)")  # fmt: skip
    return parser.parse_args(argv)


def train_step(model, opt, sched, x, y, micro_batches, seed: int, global_batch: int) -> float:
    """One optimizer step; returns the global mean loss of the step (all ranks agree on it).

    The local batch is processed in ``micro_batches`` (``sampler.micro_batches(m)``), each
    forward and backward inside ``mb.rng(seed)`` (``elastic.sample_rng``): the dropout masks
    of a micro-batch depend on its global sample positions, never on the rank, so a resume
    on another world size draws the masks of the uninterrupted run.
    """
    loss_sum = torch.zeros((), device=x.device)
    for k, mb in enumerate(micro_batches):
        model.set_requires_gradient_sync(k == len(micro_batches) - 1)  # reduce after the last
        with mb.rng(seed):  # [ft] dropout keyed by global sample position, not by rank
            loss = F.cross_entropy(model(x[mb.local]), y[mb.local], reduction="sum")
            (loss / global_batch).backward()  # this micro-batch's share of the global mean
        loss_sum += loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    total = loss_sum.clone()
    dist.all_reduce(total)
    return total.item() / global_batch


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
    log = elastic.RunRecorder(args.run_dir, rank)  # the trainer's run-dir layout

    # [ft] Fault tolerance, part 1 of 2: the data position, the checkpoint manager, the guard.
    sampler = elastic.ElasticSampler(len(dataset), args.global_batch, seed=args.seed)
    sampler.micro_batches(args.micro_batch)  # fails fast: --micro-batch must split the local batch
    state = {"model": model, "optim": opt, "sched": sched, "sampler": sampler}
    manager = ckpt.CheckpointManager(args.ckpt_dir, state, every=args.ckpt_every, seed=args.seed,
                                     async_save=args.async_save, on_event=log.event,
                                     memory_every=args.memory_every)  # fmt: skip
    guard = elastic.RunGuard(saver=manager, faults=args.fault, on_event=log.event)
    with log, manager, guard:
        start = manager.resume() or 0  # newest committed checkpoint, resharded to this world
        batches = iter(sampler.loader(dataset, num_workers=args.num_workers))  # from the cursor
        for step in guard.steps(start, args.max_steps):  # faults; SIGTERM: save, exit 143
            # [ft] End of part 1. Part 2: the lines marked [ft] below and in train_step.
            started = time.perf_counter()
            x, y = (t.to(device) for t in next(batches))
            micro_batches = sampler.micro_batches(args.micro_batch)  # [ft] this step's positions
            loss = train_step(model, opt, sched, x, y, micro_batches, args.seed, args.global_batch)
            guard.check(loss, reduced=True)  # [ft] NaN/inf: exit 3 naming the last checkpoint
            digest = elastic.samples_digest(sampler.global_batch_ids())
            sampler.advance()  # [ft] one global batch consumed
            log.metrics({
                "step": step, "loss": loss, "world_size": world, "restart_count": guard.attempt,
                "samples_digest": digest, "lr": sched.get_last_lr()[0],
                "step_time_s": time.perf_counter() - started,
            })  # fmt: skip
            manager.maybe_save(step, final=step == args.max_steps)  # [ft]
        log.event("finished", args.max_steps)


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
    device = elastic.init_distributed().device  # torchrun's group, else a 1-rank one
    try:
        train(args, device)
    except elastic.Preempted as exc:  # SIGTERM: a SystemExit with code 143, after the save
        logger.warning("rank %d: %s", dist.get_rank(), exc)
        raise
    finally:
        elastic.close_distributed()
    if rank == 0:
        logger.info("done: %d steps", args.max_steps)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as exc:  # elastic.Preempted (143), Diverged (3), argparse (0, 2)
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except Exception:  # e.g. a peer died: its collective failed here; torchrun restarts us
        traceback.print_exc()
        code = 1
    # Everything durable is done (checkpoints committed, process group destroyed): leave
    # without interpreter teardown, where torch's gloo threads occasionally abort a finished
    # rank under torchrun ("terminate called without an active exception", SIGABRT), and
    # which took seconds after a peer's death on a loaded machine.
    elastic.exit_now(code)
