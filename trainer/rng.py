"""Random-number state: derived streams and per-rank capture/restore for checkpoints.

Training randomness (dropout) is seeded per micro-batch from (seed, step, micro-batch
index), so it is reproduced on any world size without restoring anything. The rest of
the process RNG (CPU and CUDA) is still saved per rank and restored when the world size
is unchanged; on a different world size it is re-derived from (seed, step, rank).
"""

from __future__ import annotations

import hashlib

import torch

RNG_KEY_PREFIX = "rank_"
"""Per-rank RNG entries are stored as ``rng/rank_{r}`` (DCP would dedup one shared key)."""


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of the integer ``parts``."""
    blob = ",".join(str(int(p)) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") & ((1 << 63) - 1)


def seed_micro_batch(seed: int, step: int, micro_index: int) -> None:
    """Seed every device's RNG for global micro-batch ``micro_index`` of ``step``.

    The micro-batch index is global (independent of rank and world size), so dropout
    masks of a sample are the same whichever rank computes it.
    """
    torch.manual_seed(derive_seed(seed, step, micro_index, 0xD0))


def reseed_process(seed: int, step: int, rank: int) -> None:
    """Re-derive this rank's process RNG from (seed, step, rank) (resume on a new world size)."""
    torch.manual_seed(derive_seed(seed, step, rank, 0xAB))


def rng_key(rank: int) -> str:
    return f"{RNG_KEY_PREFIX}{rank}"


def capture_rng(device: torch.device) -> torch.Tensor:
    """This rank's CPU RNG state, followed by the CUDA one on a CUDA device (uint8)."""
    parts = [torch.get_rng_state()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device))
    return torch.cat(parts)


def restore_rng(state: torch.Tensor, device: torch.device) -> None:
    """Inverse of :func:`capture_rng` on the same kind of device."""
    cpu_len = torch.get_rng_state().numel()
    torch.set_rng_state(state[:cpu_len].clone())
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[cpu_len:].clone(), device)
