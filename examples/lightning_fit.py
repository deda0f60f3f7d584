"""A LightningModule trained by ``pl.Trainer`` with this project's checkpoints.

    torchrun --standalone --nproc_per_node=2 --max_restarts=3 examples/lightning_fit.py \\
        --ckpt-dir /tmp/lit_ckpt --max-steps 40

The adoption is the ``[ckpt]`` lines: an elastic sampler for the data position, the
callback, and three Trainer settings. Kill a rank (``--fault kill:step=9:rank=1``), or
relaunch on another number of ranks: the fit resumes where the last checkpoint left it.
Each rank 0 step appends ``{"step", "loss", "world_size", "restart_count"}`` to
``--run-dir``/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

import elastic
from integrations.lightning import ElasticCheckpoints


class Regressor(pl.LightningModule):
    def __init__(self, dim: int = 16, dropout: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 1)
        )
        self.metrics_path: str | None = None

    def configure_model(self) -> None:
        # ModelParallelStrategy (--strategy fsdp2): shard each layer, then the root (FSDP2)
        if getattr(self, "_device_mesh", None) is None:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        # summed over ranks, so another world size trains on the same global gradient
        total = loss.detach() * x.shape[0]
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(total)
        self._record(float(total))
        return loss

    def _record(self, total: float) -> None:
        if self.metrics_path is None or self.global_rank != 0:
            return
        row = {"step": self.global_step + 1, "loss": total, "world_size": self.trainer.world_size,
               "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}  # fmt: skip
        with open(self.metrics_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt-dir", required=True, help="checkpoint root (path or URL)")
    parser.add_argument("--run-dir", default=None, help="where metrics.jsonl goes")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--ckpt-every", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp",
                        help="fsdp2: Lightning's ModelParallelStrategy, fully_shard per layer")  # fmt: skip
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="0: no per-rank randomness (another world size then matches a "
                        "run's losses up to float rounding)")  # fmt: skip
    parser.add_argument("--fault", action="append", default=[], help="elastic fault spec")
    args = parser.parse_args(argv)

    pl.seed_everything(0, verbose=False)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(200, 16, generator=data)
    dataset = TensorDataset(x, x.sum(-1) + 0.1 * torch.randn(200, generator=data))
    model = Regressor(dropout=args.dropout)
    if args.run_dir:
        os.makedirs(args.run_dir, exist_ok=True)
        model.metrics_path = os.path.join(args.run_dir, "metrics.jsonl")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    strategy: str | pl.strategies.Strategy = "ddp" if world > 1 else "auto"
    if args.strategy == "fsdp2":
        strategy = pl.strategies.ModelParallelStrategy(
            data_parallel_size=world, tensor_parallel_size=1
        )
    # [ckpt] the data position, on any world size (bound to the trainer's rank in fit)
    sampler = elastic.ElasticSampler(len(dataset), args.global_batch, seed=0)
    callback = ElasticCheckpoints(  # [ckpt]
        args.ckpt_dir, every=args.ckpt_every, sampler=sampler, faults=args.fault
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=local,
        num_nodes=world // local,
        strategy=strategy,
        max_steps=args.max_steps,
        callbacks=[callback],  # [ckpt]
        enable_checkpointing=False,  # [ckpt] ours replaces ModelCheckpoint
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train_dataloaders=sampler.epoch_loader(dataset))  # [ckpt] resumes itself
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
