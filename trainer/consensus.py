"""Agreeing on errors across ranks so that no rank raises while the others wait.

A rank that hits a problem (bad checkpoint dir, shape mismatch) must not raise alone:
the others would block in the next collective. Every rank reports its local error (or
none), all ranks learn the first one, and all raise it together.
"""

from __future__ import annotations

import torch.distributed as dist


def first_error(local_error: str | None) -> str | None:
    """The lowest rank's error message, or None if no rank has one (collective, all ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local_error
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local_error)
    for rank, message in enumerate(gathered):
        if message is not None:
            return message if rank == dist.get_rank() else f"(reported by rank {rank}) {message}"
    return None
