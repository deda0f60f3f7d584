"""Builders for the training components: model (sharded with FSDP2) and optimizer.

Every rank calls them in the same order right after the process group is set up.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from trainer.config import OptimConfig, TrainConfig
from trainer.distributed import DistContext
from trainer.model import GPT
from trainer.rng import derive_seed
from trainer.shard_local import ShardLocalAdamW

logger = logging.getLogger(__name__)


def build_model(cfg: TrainConfig, vocab_size: int, ctx: DistContext) -> GPT:
    """The GPT, initialized identically on every rank, then sharded per block and at the root.

    Initialization is seeded from ``run.seed`` only, so the parameters are the same on
    every world size. Gradients are reduced by SUM (divide factor 1): the loss is already
    divided by the global batch, so the update does not depend on the world size.
    """
    torch.manual_seed(derive_seed(cfg.run.seed, 0x1A17))
    model = GPT(cfg.model, vocab_size).to(ctx.device)
    mp_policy = MixedPrecisionPolicy()
    if cfg.run.mixed_precision == "bf16":
        if ctx.device.type == "cuda":
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            logger.warning(
                "rank %d: run.mixed_precision='bf16' applies on CUDA only; training in fp32 on CPU",
                ctx.rank,
            )
    for block in model.blocks:
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # SUM reduction; forced so gloo (no PREMUL_SUM) gets a plain SUM too.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "rank %d: GPT with %.2fM parameters, sharded over %d ranks",
        ctx.rank,
        n_params / 1e6,
        ctx.world_size,
    )
    return model


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not biases, norms), stepped on each
    rank's shards (:mod:`trainer.shard_local`)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return ShardLocalAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
