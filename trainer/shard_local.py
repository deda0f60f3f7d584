"""AdamW's update and the gradient clip on each rank's own shards.

FSDP2 keeps the parameters, their gradients and AdamW's moments as DTensors sharded
along the one dimension of the world's mesh. Every op on a DTensor goes through
DTensor's dispatch, whose sharding propagation is worked out once per (op, shapes,
placements) and cached in the process: a new process, which every restart is, pays it
on its first step (for the tiny GPT on 2 cores about 0.3 s, three steps' worth, most of
the first step after a restart), and every later op still pays the dispatch.

AdamW's update and the clip's scaling are elementwise, and a gradient norm over shards
is a sum of per-shard squares, so on the local shards they are the ops DTensor would
run there: the update is bitwise the one ``torch.optim.AdamW`` makes
(tests/test_trainer_shard_local.py), and the norm is the same up to the order of one
float sum. Anything else takes torch's own path: a parameter that is not a DTensor
sharded on a 1-D mesh (DDP, one process, tensor parallel), AMP's grad scaling, a
capturable optimizer (``differentiable=True`` is refused).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard
from torch.optim.adam import adam
from torch.optim.optimizer import _default_to_fused_or_foreach


def local_shards(tensors: list[Tensor]) -> list[Tensor] | None:
    """Each tensor's local shard, when every one is a DTensor sharded (``Shard``) on one
    and the same 1-D mesh; otherwise None (the caller takes torch's path)."""
    mesh = None
    out = []
    for t in tensors:
        if not isinstance(t, DTensor) or t.device_mesh.ndim != 1:
            return None
        if not all(isinstance(p, Shard) for p in t.placements):
            return None
        if mesh is None:
            mesh = t.device_mesh
        elif t.device_mesh != mesh:
            return None
        out.append(t.to_local())
    return out


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_(parameters, max_norm)`` for sharded gradients,
    reduced once over the mesh; returns the total 2-norm as a plain tensor, the same on
    every rank. Other gradients: torch's function (its result as a full tensor)."""
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    shards = local_shards(grads)
    if shards is None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    group = grads[0].device_mesh.get_group()
    norms = torch._foreach_norm(shards, 2.0)
    squares = torch.stack(norms).square().sum()
    dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    if math.isinf(max_norm):
        return total
    # torch's clip: the factor is capped at 1 and always applied (a no-op when it is 1)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(shards, coefficient.to(shards[0].device))
    return total


class ShardLocalAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose update runs on the local shards of FSDP2's DTensors
    (see the module docstring): the same state, state dict, hooks and results; only the
    dispatch is skipped. A group it cannot take that way is stepped by AdamW's own code."""

    ckpt_adam_state = True
    """Its state is AdamW's (``_init_group`` is not changed): a resume creates it the way
    the first step would instead of running DCP's zero-learning-rate step
    (``ckpt.state.app_state.init_adam_state``)."""

    def __init__(self, params, **kwargs) -> None:
        if kwargs.get("differentiable"):
            raise ValueError("ShardLocalAdamW: differentiable=True is not supported; use AdamW")
        super().__init__(params, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        self._accelerator_graph_capture_health_check()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            exp_avgs: list[Tensor] = []
            exp_avg_sqs: list[Tensor] = []
            max_exp_avg_sqs: list[Tensor] = []
            steps: list[Tensor] = []
            has_complex = self._init_group(
                group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
            )
            if not params:
                continue
            foreach, fused = group["foreach"], group["fused"]
            if foreach is None and fused is None:
                # the choice torch makes for these parameters (DTensors), not for their shards
                _, foreach = _default_to_fused_or_foreach(params, False, use_fused=False)
                if foreach and isinstance(group["lr"], Tensor) and not group["capturable"]:
                    foreach = False
            lists = [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs]
            plain_steps = not any(isinstance(s, DTensor) for s in steps)
            if grad_scale is None and not group["capturable"] and plain_steps:
                local = [local_shards(ts) if ts else [] for ts in lists]
                if all(ts is not None for ts in local):
                    lists = local
            beta1, beta2 = group["betas"]
            adam(
                *lists,
                steps,
                amsgrad=group["amsgrad"],
                has_complex=has_complex,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
                foreach=foreach,
                capturable=group["capturable"],
                differentiable=False,
                fused=fused,
                grad_scale=grad_scale,
                found_inf=getattr(self, "found_inf", None),
                decoupled_weight_decay=group["decoupled_weight_decay"],
            )
        return loss
