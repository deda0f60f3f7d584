"""trainer.shard_local: AdamW's update and the gradient clip on FSDP2's local shards are
torch's own results, without DTensor's dispatch (real gloo ranks for the sharded cases)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from testing.spawn import run_ok
from trainer.shard_local import ShardLocalAdamW, clip_grad_norm, local_shards


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # odd sizes: two ranks hold shards of different lengths, one of them short
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def _groups(model: torch.nn.Module) -> list[dict]:
    return [
        {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]


def _backward(model: torch.nn.Module, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    model(torch.randn(4, 7, generator=g)).square().mean().backward()


class DispatchCounter(TorchDispatchMode):
    """Counts the ops called on DTensors (each one goes through DTensor's dispatch)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [*tree_leaves(args), *tree_leaves(kwargs or {})]
        if any(isinstance(a, DTensor) for a in flat):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def optimizer_worker(rank: int, world: int) -> dict:
    base = _model()
    torch_model, ours_model = copy.deepcopy(base), copy.deepcopy(base)
    for m in (torch_model, ours_model):
        fully_shard(m)
    torch_opt = torch.optim.AdamW(_groups(torch_model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ours_opt = ShardLocalAdamW(_groups(ours_model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    hooked = []
    ours_opt.register_step_pre_hook(lambda opt, args, kwargs: hooked.append(opt))
    torch_calls, ours_calls = [], []
    for step in range(1, 5):
        for model, opt, calls in (
            (torch_model, torch_opt, torch_calls),
            (ours_model, ours_opt, ours_calls),
        ):
            _backward(model, step, rank)
            with DispatchCounter() as counter:
                opt.step()
            calls.append(counter.calls)
            opt.zero_grad(set_to_none=True)
    mismatched = []
    for (name, a), b in zip(torch_model.named_parameters(), ours_model.parameters(), strict=True):
        if not torch.equal(_local(a), _local(b)):
            mismatched.append(name)
        sa, sb = torch_opt.state[a], ours_opt.state[b]
        for key in ("step", "exp_avg", "exp_avg_sq"):
            if not torch.equal(_local(sa[key]), _local(sb[key])):
                mismatched.append(f"{name}.{key}")
            if type(sa[key]) is not type(sb[key]):
                mismatched.append(f"{name}.{key} type")
    return {
        "mismatched": mismatched,
        "torch_calls": torch_calls,
        "ours_calls": ours_calls,
        "hooked": len(hooked),
        "same_state_keys": torch_opt.state_dict().keys() == ours_opt.state_dict().keys(),
    }


@pytest.mark.timeout(120)
def test_the_update_on_shards_is_bitwise_adamws_without_dtensor_dispatch():
    for result in run_ok(optimizer_worker, 2, timeout_s=100):
        assert result["mismatched"] == []
        # torch's AdamW dispatches every op of every step through DTensor; ours none
        # once the state exists (the first step creates it with zeros_like on DTensors)
        assert min(result["torch_calls"]) > 20
        assert result["ours_calls"][1:] == [0, 0, 0]
        assert result["hooked"] == 4 and result["same_state_keys"]


def clip_worker(rank: int, world: int, max_norm: float) -> dict:
    base = _model()
    torch_model, ours_model = copy.deepcopy(base), copy.deepcopy(base)
    for m in (torch_model, ours_model):
        fully_shard(m)
        _backward(m, 1, rank)
    expected = torch.nn.utils.clip_grad_norm_(torch_model.parameters(), max_norm).full_tensor()
    with DispatchCounter() as counter:
        got = clip_grad_norm(ours_model.parameters(), max_norm)
    worst = max(
        (_local(a.grad) - _local(b.grad)).abs().max().item()
        for a, b in zip(torch_model.parameters(), ours_model.parameters(), strict=True)
    )
    return {
        "expected": expected.item(),
        "got": got.item(),
        "plain": not isinstance(got, DTensor),
        "worst_grad_diff": worst,
        "dispatches": counter.calls,
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_norm", [0.05, math.inf])
def test_the_clip_on_shards_is_torchs_within_one_sum_order(max_norm):
    results = run_ok(clip_worker, 2, max_norm, timeout_s=100)
    assert results[0]["got"] == results[1]["got"]  # one norm, the same on every rank
    for r in results:
        assert r["plain"] and r["dispatches"] == 0
        assert r["got"] == pytest.approx(r["expected"], rel=1e-6)
        assert r["worst_grad_diff"] <= 1e-7
    if max_norm == 0.05:
        assert results[0]["expected"] > 0.05  # the clip did scale the gradients


def test_unsharded_parameters_take_torchs_path_with_the_same_results():
    torch_model, ours_model = _model(), _model()
    torch_opt = torch.optim.AdamW(_groups(torch_model), lr=1e-2)
    ours_opt = ShardLocalAdamW(_groups(ours_model), lr=1e-2)
    assert local_shards([p for p in ours_model.parameters()]) is None
    for step in range(1, 4):
        for model in (torch_model, ours_model):
            _backward(model, step, 0)
        expected = torch.nn.utils.clip_grad_norm_(torch_model.parameters(), 0.05)
        got = clip_grad_norm(ours_model.parameters(), 0.05)
        assert torch.equal(expected, got)
        for opt in (torch_opt, ours_opt):
            opt.step()
            opt.zero_grad()
    for a, b in zip(torch_model.parameters(), ours_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_differentiable_optimizer_is_refused_by_name():
    with pytest.raises(ValueError, match="differentiable"):
        ShardLocalAdamW(_model().parameters(), differentiable=True)


def test_a_resume_makes_its_state_as_adamws_first_step_would():
    from ckpt.state.app_state import init_adam_state

    made, stepped = _model(), _model()
    made_opt = ShardLocalAdamW(_groups(made), lr=1e-2)
    stepped_opt = ShardLocalAdamW(_groups(stepped), lr=1e-2)
    assert init_adam_state(made_opt)  # no zero-learning-rate step of DCP's on a resume
    for model, opt in ((made, made_opt), (stepped, stepped_opt)):
        _backward(model, 1, 0)
        opt.step()
    for a, b in zip(made.parameters(), stepped.parameters(), strict=True):
        assert torch.equal(a, b)
        state = made_opt.state[a]
        assert all(torch.equal(state[k], stepped_opt.state[b][k]) for k in state)
