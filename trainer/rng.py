"""Random-number streams of the trainer.

Training randomness (dropout) is drawn inside ``elastic.sample_rng(seed, step, global
micro-batch index)`` around each micro-batch's forward and backward (``trainer/loop.py``),
so it is reproduced on any world size without restoring anything. The rest of the
process RNG (CPU and CUDA) is saved per rank by ``ckpt.CheckpointManager`` and restored
when the world size is unchanged; on a different world size it is re-derived from
(seed, step, rank) (``ckpt.state.rng``). Model initialization is seeded from ``derive_seed``.
"""

from __future__ import annotations

from ckpt.state.rng import derive_seed

__all__ = ["derive_seed"]
