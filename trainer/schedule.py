"""Learning-rate schedule: linear warmup then cosine decay, a pure function of the step.

Being stateless, the schedule needs nothing in the checkpoint beyond the step itself.
"""

from __future__ import annotations

import math

from trainer.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step ``step`` (1-based).

    Steps ``1..warmup_steps`` rise linearly to ``lr``; then a half cosine falls to
    ``min_lr`` at ``decay_steps``; after that it stays at ``min_lr``.
    """
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if step >= cfg.decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / (cfg.decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
