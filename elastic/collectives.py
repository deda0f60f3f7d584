"""Tiny collectives over small vectors of numbers, used by the elastic package.

Restart counts, preemption votes and straggler timings are a handful of numbers per
rank. These helpers move them through a process group on the device the group's
backend needs (NCCL only accepts CUDA tensors, gloo takes CPU tensors), and fall back
to the local values when no process group is initialized, so single-process runs need
no special casing.

Every function here is a collective: all ranks of the group must call it, in the same
order, with vectors of the same length.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def distributed_ready() -> bool:
    """Return True when torch.distributed is usable and a default group exists.

    Any rank may call it; it is local and never blocks.
    """
    return dist.is_available() and dist.is_initialized()


def collective_device(process_group: dist.ProcessGroup | None = None) -> torch.device:
    """Return the device a tensor must live on for collectives over `process_group`.

    A group whose backend is only NCCL needs CUDA tensors; a group with a CPU backend
    (gloo, or a mixed "cpu:gloo,cuda:nccl" default group) takes CPU tensors, which are
    cheaper for a few numbers. Any rank may call it; it is local.
    """
    backend = str(dist.get_backend(process_group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max_ints(
    values: Sequence[int], process_group: dist.ProcessGroup | None = None
) -> list[int]:
    """Return the element-wise maximum of `values` over every rank of the group.

    Collective: every rank of `process_group` (default group when None) calls it with
    a vector of the same length. Without an initialized process group it returns the
    local values unchanged.
    """
    if not distributed_ready():
        return [int(v) for v in values]
    device = collective_device(process_group)
    tensor = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=process_group)
    return [int(v) for v in tensor.cpu().tolist()]


def all_gather_floats(value: float, process_group: dist.ProcessGroup | None = None) -> list[float]:
    """Return one float from every rank of the group, indexed by group rank.

    Collective: every rank of `process_group` (default group when None) calls it.
    Without an initialized process group it returns `[value]`.
    """
    if not distributed_ready():
        return [float(value)]
    device = collective_device(process_group)
    world = dist.get_world_size(process_group)
    local = torch.tensor([float(value)], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=process_group)
    return [float(t.item()) for t in gathered]
