"""Per-rank random-number state: capture, restore, and re-derivation on a new world size.

DCP deduplicates a non-sharded item saved under the same key by several ranks (one
copy survives), so each rank's RNG is saved under its own key, ``rng/rank_{r}``. It is
restored only when the world size is unchanged: rank ``r`` of another world size is a
different process with a different share of the work, and gets a stream derived from
``(seed, step, rank)`` instead.
"""

from __future__ import annotations

import hashlib

import torch

RNG_STATE_KEY = "rng"
"""Top-level key of the per-rank RNG entries in a checkpoint's state."""
RNG_KEY_PREFIX = "rank_"
"""Per-rank RNG entries are stored as ``rng/rank_{r}``."""


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of the integer ``parts``."""
    blob = ",".join(str(int(p)) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") & ((1 << 63) - 1)


def reseed_process(seed: int, step: int, rank: int) -> None:
    """Re-derive this rank's process RNG from (seed, step, rank) (resume on a new world size)."""
    torch.manual_seed(derive_seed(seed, step, rank, 0xAB))


def rng_key(rank: int) -> str:
    return f"{RNG_KEY_PREFIX}{rank}"


def rng_device() -> torch.device:
    """The device whose generator is saved besides the CPU one: the current CUDA device, if any."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
