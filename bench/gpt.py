"""The trainer's tiny GPT and data, built the way ``trainer`` builds them, for bench loops.

Used by the plain FSDP2 loop (the baseline of ``trainer_overhead``) and by the
training steps that run while an async save persists (``persist_interference``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(os.path.dirname(trainer.__file__), "configs", "tiny_gpt.toml")
"""The tiny GPT's config, shipped with the trainer (``examples/tiny_gpt.toml`` links to it)."""


@dataclass(slots=True)
class TinyGpt:
    cfg: Any
    ctx: Any
    model: Any
    optimizer: Any
    samples: Any
    order: Any
    sampler: Any
    """The trainer's data position (``elastic.ElasticSampler`` over the same order)."""
    layout: Any


def build_tiny_gpt(rank: int, world: int) -> TinyGpt:
    """Model, optimizer and data of ``examples/tiny_gpt.toml`` on this rank (collective)."""
    import torch

    from elastic.sampler import ElasticSampler
    from trainer.build import build_model, build_optimizer
    from trainer.config import load_config
    from trainer.data import BatchLayout, GlobalOrder, build_samples
    from trainer.distributed import DistContext

    cfg = load_config(CONFIG)
    ctx = DistContext(
        rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo"
    )
    samples = build_samples(cfg.data, cfg.model.seq_len, cfg.model.vocab_size)
    model = build_model(cfg, samples.vocab_size, ctx)
    return TinyGpt(
        cfg=cfg,
        ctx=ctx,
        model=model,
        optimizer=build_optimizer(model, cfg.optim),
        samples=samples,
        order=GlobalOrder(len(samples), cfg.data.seed),
        sampler=ElasticSampler(
            len(samples), cfg.data.global_batch, seed=cfg.data.seed, rank=rank, world_size=world
        ),
        layout=BatchLayout.plan(cfg.data.global_batch, cfg.data.micro_batch, world),
    )


def plain_step(g: TinyGpt, cursor: int) -> None:
    """One optimizer step with nothing but FSDP2: accumulate, clip, AdamW step.

    Same micro-batches (ids, sizes, accumulation), clip and AdamW (on the shards,
    :mod:`trainer.shard_local`) as the trainer's step at ``cursor``,
    without its extras (loss all-reduce, sample-id gather, per-micro-batch seeding,
    metrics, watchdog, checkpoint bookkeeping).
    """
    from trainer.data import micro_batch_ids
    from trainer.shard_local import clip_grad_norm

    g.model.train()
    ids_list = micro_batch_ids(g.order, cursor, g.layout, g.ctx.rank)
    for k, ids in enumerate(ids_list):
        inputs, targets = g.samples.get(ids)
        g.model.set_requires_gradient_sync(k == g.layout.accum - 1)
        per_sample = g.model(inputs, targets)
        (per_sample.sum() / g.layout.global_batch).backward()
    clip_grad_norm(g.model.parameters(), g.cfg.optim.grad_clip)
    g.optimizer.step()
    g.optimizer.zero_grad(set_to_none=True)
