"""Random-number streams of the trainer.

Training randomness (dropout) is seeded per micro-batch from (seed, step, micro-batch
index), so it is reproduced on any world size without restoring anything. The rest of
the process RNG (CPU and CUDA) is saved per rank by ``ckpt.CheckpointManager`` and
restored when the world size is unchanged; on a different world size it is re-derived
from (seed, step, rank) (``ckpt.rng``).
"""

from __future__ import annotations

import torch

from ckpt.rng import derive_seed


def seed_micro_batch(seed: int, step: int, micro_index: int) -> None:
    """Seed every device's RNG for global micro-batch ``micro_index`` of ``step``.

    The micro-batch index is global (independent of rank and world size), so dropout
    masks of a sample are the same whichever rank computes it.
    """
    torch.manual_seed(derive_seed(seed, step, micro_index, 0xD0))
