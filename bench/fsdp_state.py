"""The state a benchmark saves: an FSDP2 MLP and its AdamW optimizer, as a trainer would.

Parameters, ``exp_avg`` and ``exp_avg_sq`` are all fp32, so the checkpoint is about
12 bytes per parameter; :func:`layer_width` picks square layers to hit a total size.
"""

from __future__ import annotations

import math
from typing import Any

import torch

LAYERS = 4
BYTES_PER_PARAM = 12  # fp32 parameter + AdamW exp_avg + exp_avg_sq


def layer_width(total_bytes: int) -> int:
    """Width of ``LAYERS`` square linear layers whose checkpoint is about ``total_bytes``."""
    return max(64, int(math.sqrt(total_bytes / (BYTES_PER_PARAM * LAYERS))))


def build_trained(width: int, seed: int = 0) -> tuple[Any, Any]:
    """FSDP2 model + AdamW after one step (so the optimizer state exists); collective."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(LAYERS)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def sharded_state(model: Any, optim: Any) -> dict[str, Any]:
    """``{"model", "optim", "step"}`` with DTensor shards, as ``ckpt.save`` takes it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "step": 1}


def full_state(model: Any, optim: Any) -> dict[str, Any]:
    """The same keys with full CPU tensors on every rank (a world-1 layout); collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd, osd = get_state_dict(model, optim, options=opts)
    return {"model": msd, "optim": osd, "step": 1}


def local_tensor_bytes(state: Any) -> int:
    """Bytes of the tensors this rank holds in ``state`` (DTensors count their local shard)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return local_tensor_bytes(state.to_local())
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(local_tensor_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(local_tensor_bytes(v) for v in state)
    return 0
