"""CheckpointManager, ElasticSampler and RunGuard: the public API and the traps it closes.

Each test names a trap a user fell into with the lower-level API: per-rank RNG under one
key, a load template that steps a fresh optimizer, schedulers and data position lost
across world sizes, storage faults that silently did nothing, and SIGTERM with async
saves that exited without an emergency checkpoint.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import ckpt
import elastic
from testing.spawn import run_ok

pytestmark = pytest.mark.timeout(300)

GLOBAL_BATCH = 8


def _model_and_optim(seed: int = 0, *, shard: bool):
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def _scheduler(optim):
    from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

    warm = LinearLR(optim, start_factor=0.1, total_iters=2)
    cos = CosineAnnealingLR(optim, T_max=10)
    return SequentialLR(optim, [warm, cos], milestones=[2])


def _step(model, optim, sched, sampler) -> float:
    ids = torch.as_tensor(sampler.local_batch_ids())
    x = torch.sin(ids[:, None].float() * torch.arange(1, 7).float())
    loss = model(x).pow(2).sum() / GLOBAL_BATCH
    loss.backward()
    optim.step()
    optim.zero_grad()
    sched.step()
    sampler.advance()
    return float(loss)


# -- per-rank RNG ------------------------------------------------------------------------


def _rng_save(rank: int, world: int, root: str) -> list[float]:
    model, optim = _model_and_optim(shard=True)
    manager = ckpt.CheckpointManager(root, {"model": model, "optim": optim}, seed=5)
    torch.manual_seed(100 + rank)  # each rank's own stream
    manager.save(3)
    manager.close()
    return torch.rand(4).tolist()  # what each rank draws next


def _rng_resume(rank: int, world: int, root: str) -> dict:
    model, optim = _model_and_optim(shard=True)
    manager = ckpt.CheckpointManager(root, {"model": model, "optim": optim}, seed=5)
    torch.manual_seed(999)  # a restarted process starts elsewhere
    step = manager.resume()
    out = {
        "step": step,
        "draw": torch.rand(4).tolist(),
        "restored": manager.last_resume.rng_restored,
    }
    manager.close()
    return out


def test_each_rank_resumes_its_own_rng_and_a_new_world_size_re_derives_it(tmp_path):
    root = str(tmp_path / "ckpt")
    expected = run_ok(_rng_save, 2, root)
    assert expected[0] != expected[1]
    same = run_ok(_rng_resume, 2, root)
    assert [r["draw"] for r in same] == expected  # rank 1 did not get rank 0's stream
    assert all(r["restored"] and r["step"] == 3 for r in same)

    from torch.distributed.checkpoint import FileSystemReader

    saved_keys = FileSystemReader(os.path.join(root, "checkpoint_0000003")).read_metadata()
    assert {"rng.rank_0", "rng.rank_1"} <= set(saved_keys.state_dict_metadata)

    other = run_ok(_rng_resume, 1, root)[0]
    assert not other["restored"]
    torch.manual_seed(ckpt.state.rng.derive_seed(5, 3, 0, 0xAB))
    assert other["draw"] == torch.rand(4).tolist()


# -- a fresh optimizer is never stepped ---------------------------------------------------


def _losses(manager_root: str | None, steps: int = 4) -> list[float]:
    model, optim = _model_and_optim(shard=False)
    if manager_root is not None:
        manager = ckpt.CheckpointManager(manager_root, {"model": model, "optim": optim})
        assert manager.resume() is None
        assert not optim.state, "resume() on an empty root touched the optimizer"
    x = torch.linspace(-1, 1, 24).reshape(4, 6)
    losses = []
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_fresh_run_with_a_manager_matches_one_without_bitwise(tmp_path):
    assert _losses(str(tmp_path / "empty")) == _losses(None)


def test_saving_and_resuming_an_optimizer_that_never_stepped_leaves_it_fresh(tmp_path):
    root = str(tmp_path / "ckpt")
    model, optim = _model_and_optim(shard=False)
    manager = ckpt.CheckpointManager(root, {"model": model, "optim": optim})
    assert manager.save(0) is not None
    assert not optim.state, "saving a fresh optimizer ran a step to create its state"
    model2, optim2 = _model_and_optim(seed=1, shard=False)
    again = ckpt.CheckpointManager(root, {"model": model2, "optim": optim2})
    assert again.resume() == 0
    assert not optim2.state
    assert torch.equal(model2[0].weight, model[0].weight)


# -- an Adam template's state without DCP's zero step ---------------------------------------


def _first_steps(optim_cls, init: bool, **kwargs) -> tuple[list[float], list[torch.Tensor]]:
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    model[2].bias.requires_grad_(False)
    optim = optim_cls(model.parameters(), lr=1e-2, **kwargs)
    if init:
        assert ckpt.state.app_state.init_adam_state(optim)
        assert model[2].bias not in optim.state  # no grad, no state (as Adam's own init)
    x = torch.linspace(-1, 1, 24).reshape(4, 6)
    losses = []
    for _ in range(3):
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "optim_cls, kwargs",
    [(torch.optim.AdamW, {}), (torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.1})],
)
def test_adam_state_made_ahead_of_the_first_step_trains_as_a_fresh_optimizer(optim_cls, kwargs):
    fresh_losses, fresh_params = _first_steps(optim_cls, False, **kwargs)
    losses, params = _first_steps(optim_cls, True, **kwargs)
    assert losses == fresh_losses
    assert all(torch.equal(a, b) for a, b in zip(params, fresh_params, strict=True))


def test_adam_state_is_not_made_for_other_optimizers_or_ones_with_state():
    from torch import nn

    class MyAdam(torch.optim.AdamW):
        pass

    model = nn.Linear(3, 2)
    for optim in (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        MyAdam(model.parameters()),
    ):
        assert not ckpt.state.app_state.init_adam_state(optim) and not optim.state

    class DeclaredAdam(torch.optim.AdamW):
        ckpt_adam_state = True  # its state is AdamW's: created as AdamW's is

    class OwnStateAdam(DeclaredAdam):
        def _init_group(self, *args):  # says so, but makes its own state: not taken
            return super()._init_group(*args)

    declared = DeclaredAdam(model.parameters())
    assert ckpt.state.app_state.init_adam_state(declared)
    assert {k for v in declared.state.values() for k in v} == {"step", "exp_avg", "exp_avg_sq"}
    own = OwnStateAdam(model.parameters())
    assert not ckpt.state.app_state.init_adam_state(own) and not own.state
    stepped = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    assert not ckpt.state.app_state.init_adam_state(stepped)  # grads present: DCP's path
    stepped.step()
    before = {k: dict(v) for k, v in stepped.state.items()}
    assert not ckpt.state.app_state.init_adam_state(stepped)
    assert {k: dict(v) for k, v in stepped.state.items()} == before


def test_a_declared_adam_subclass_is_taken_after_torch_dynamo_rewrapped_adamw(monkeypatch):
    # torch._dynamo's TorchPatcher wraps each torch optimizer's _init_group on its own
    # class once dynamo runs: AdamW's is then no longer Adam's object, yet still torch's.
    from torch import nn

    original = torch.optim.Adam._init_group
    monkeypatch.setattr(torch.optim.AdamW, "_init_group", lambda self, *a: original(self, *a))

    class DeclaredAdam(torch.optim.AdamW):
        ckpt_adam_state = True

    assert ckpt.state.app_state.init_adam_state(DeclaredAdam(nn.Linear(3, 2).parameters()))


def _adam_templates(rank: int, world: int) -> list[tuple]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    out = []
    for ours in (True, False):
        model, optim = _model_and_optim(shard=True)
        if ours:
            assert ckpt.state.app_state.init_adam_state(optim)
        sd = get_optimizer_state_dict(model, optim)
        rows = []
        for fqn, entry in sorted(sd["state"].items()):
            for name, value in sorted(entry.items()):
                row = [fqn, name, type(value).__name__, str(value.dtype), tuple(value.shape)]
                if isinstance(value, DTensor):
                    row += [str(value.placements), tuple(value.to_local().shape)]
                    value = value.to_local()
                row.append(value.tolist() if name != "step" else None)
                rows.append(tuple(row))
        steps = sorted({float(e["step"]) for e in sd["state"].values()})
        out.append((rows, steps, sd["param_groups"][0]["lr"]))
    return out


def test_fsdp2_adam_template_matches_dcps_zero_step_except_the_step_counter():
    for ours, dcp in run_ok(_adam_templates, 2):
        assert ours[0] == dcp[0] and ours[0]  # same entries, shapes, placements, zeros
        assert ours[1] == [0.0] and dcp[1] == [1.0]  # DCP's zero step counted one step
        assert ours[2] == dcp[2] == 1e-2


# -- scheduler, sampler and plain values across world sizes ---------------------------------


def _train_and_save(rank: int, world: int, root: str, steps: int) -> dict:
    model, optim = _model_and_optim(shard=True)
    sched = _scheduler(optim)
    sampler = elastic.ElasticSampler(1000, GLOBAL_BATCH, seed=3)
    state = {"model": model, "optim": optim, "sched": sched, "sampler": sampler, "epoch": 0}
    manager = ckpt.CheckpointManager(root, state, every=steps)
    for step in range(1, steps + 1):
        _step(model, optim, sched, sampler)
        state["epoch"] = 7
        manager.maybe_save(step)
    manager.close()
    return {
        "last_lr": sched.get_last_lr(),
        "last_epoch": sched.last_epoch,
        "cursor": sampler.cursor,
        "next_ids": sampler.global_batch_ids().tolist(),
    }


def _resume_state(rank: int, world: int, root: str) -> dict:
    model, optim = _model_and_optim(seed=9, shard=True)
    sched = _scheduler(optim)
    sampler = elastic.ElasticSampler(1000, GLOBAL_BATCH, seed=3)
    state = {"model": model, "optim": optim, "sched": sched, "sampler": sampler, "epoch": 0}
    manager = ckpt.CheckpointManager(root, state)
    step = manager.resume()
    manager.close()
    return {
        "step": step,
        "last_lr": sched.get_last_lr(),
        "last_epoch": sched.last_epoch,
        "cursor": sampler.cursor,
        "next_ids": sampler.global_batch_ids().tolist(),
        "local_ids": sampler.local_batch_ids().tolist(),
        "lr": optim.param_groups[0]["lr"],
        "epoch": state["epoch"],
    }


def test_scheduler_sampler_and_plain_values_resume_on_another_world_size(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = run_ok(_train_and_save, 2, root, 3)[0]
    assert saved["cursor"] == 3 * GLOBAL_BATCH
    for world in (1, 2):
        got = run_ok(_resume_state, world, root)
        for rank, r in enumerate(got):
            assert r["step"] == 3
            assert r["last_epoch"] == saved["last_epoch"] == 3
            assert r["last_lr"] == saved["last_lr"]
            assert r["lr"] == pytest.approx(saved["last_lr"][0], rel=0, abs=0)
            assert r["cursor"] == saved["cursor"]
            assert r["next_ids"] == saved["next_ids"]  # the same global samples come next
            per_rank = GLOBAL_BATCH // world
            assert r["local_ids"] == saved["next_ids"][rank * per_rank : (rank + 1) * per_rank]
            assert r["epoch"] == 7


def test_sampler_refuses_a_checkpoint_of_another_order():
    sampler = elastic.ElasticSampler(100, 8, seed=1, rank=0, world_size=1)
    state = sampler.state_dict()
    other = elastic.ElasticSampler(100, 8, seed=2, rank=0, world_size=1)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)


def test_sampler_loader_does_not_draw_from_the_global_rng():
    sampler = elastic.ElasticSampler(64, 8, seed=1, rank=1, world_size=2)
    loader = sampler.loader(torch.arange(64))
    before = torch.get_rng_state()
    batches = iter(loader)
    first = next(batches)
    assert torch.equal(torch.get_rng_state(), before)
    assert first.tolist() == sampler.local_batch_ids().tolist()


# -- faults through the public grammar ------------------------------------------------------


def test_a_ckpt_storage_fault_spec_fails_one_save_and_training_goes_on(tmp_path):
    root = str(tmp_path / "ckpt")
    events: list[tuple[str, int, dict]] = []
    model, optim = _model_and_optim(shard=False)

    def record(name: str, step: int, **fields) -> None:
        events.append((name, step, fields))

    manager = ckpt.CheckpointManager(
        root, {"model": model, "optim": optim}, every=1, on_event=record
    )
    spec = "ckpt-storage:step=2:phase=manifest:error=permanent"
    guard = elastic.RunGuard(
        saver=manager, faults=[spec], on_event=record, env={}, rank=0, attempt=0
    )
    with guard:
        for step in guard.steps(0, 3):
            model(torch.ones(2, 6)).sum().backward()
            optim.step()
            optim.zero_grad()
            manager.maybe_save(step)
    manager.close()
    committed = [i.step for i in ckpt.list_checkpoints(root) if i.committed]
    assert committed == [3, 1]
    assert [s for n, s, _ in events if n == "checkpoint_failed"] == [2]
    faults = [f for n, _, f in events if n == "fault"]
    assert faults and faults[0]["every_rank"] is True and "phase=manifest" in faults[0]["spec"]


def test_storage_fault_env_grammar_is_the_fault_spec_grammar():
    from ckpt.storage.faults import StorageFault, parse_storage_faults

    assert parse_storage_faults("ckpt-storage:phase=complete:error=kill:rank=0:times=2") == [
        StorageFault(phase="complete", kind="kill", rank=0, times=2)
    ]
    assert parse_storage_faults("complete:kill:rank=0") == [
        StorageFault(phase="complete", kind="kill", rank=0)
    ]
    spec = elastic.parse_fault_spec("ckpt-storage:step=4:rank=1:phase=read:error=http503")
    assert parse_storage_faults(spec.storage_spec()) == [StorageFault(phase="read", kind="http503")]
    with pytest.raises(ValueError, match="unknown key"):
        elastic.parse_fault_spec("kill:step=1:phase=shard")  # storage keys only for ckpt-storage


# -- SIGTERM with async saves ----------------------------------------------------------------


def _preempted_async(rank: int, world: int, root: str) -> dict:
    model, optim = _model_and_optim(shard=True)
    sampler = elastic.ElasticSampler(1000, GLOBAL_BATCH, seed=3)
    sched = _scheduler(optim)
    manager = ckpt.CheckpointManager(
        root, {"model": model, "optim": optim, "sched": sched, "sampler": sampler},
        every=50, async_save=True,
    )  # fmt: skip
    estimate = manager.expected_save_s()
    try:
        with manager, elastic.RunGuard(saver=manager, faults=["sigterm:step=4:rank=1"]) as guard:
            for _step_no in guard.steps(0, 10):
                _step(model, optim, sched, sampler)
    except elastic.Preempted as exc:
        return {"code": exc.code, "step": exc.step, "saved": exc.saved, "estimate": estimate}
    return {"code": 0}


def test_sigterm_with_async_saves_commits_an_emergency_checkpoint_of_the_stopped_step(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_ok(_preempted_async, 2, root, env={"TRAINER_PREEMPTION_GRACE_S": "30"})
    assert [r["code"] for r in results] == [143, 143]
    assert [r["step"] for r in results] == [3, 3]
    assert all(r["saved"] for r in results)
    assert all(0 < r["estimate"] < 30 for r in results)  # a size-based estimate, not None
    committed = [i.step for i in ckpt.list_checkpoints(root) if i.committed]
    assert committed == [3]
    info = ckpt.find_latest_committed(root)
    assert json.loads(json.dumps(info.manifest.metadata))["ckpt_manager"]["keys"] == [
        "model", "optim", "sampler", "sched",
    ]  # fmt: skip
    assert os.path.exists(os.path.join(root, "checkpoint_0000003", "COMPLETE"))


@pytest.mark.parametrize(
    "optim_cls, kwargs", [(torch.optim.AdamW, {}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})]
)
def test_a_resume_into_a_fresh_optimizer_whose_parameters_hold_gradients_loads_its_state(
    tmp_path, optim_cls, kwargs
):
    """A backward pass before the resume (a second fit in one process) left gradients on the
    parameters of a never-stepped optimizer: its state is still loaded (it was silently
    dropped: neither Adam's ahead-of-time state nor DCP's zero step touch such an
    optimizer), and the gradients stay as they were."""
    from torch import nn

    def build():
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        return model, optim_cls(model.parameters(), **kwargs)

    x = torch.linspace(-1, 1, 8).reshape(2, 4)
    model, optim = build()
    for _ in range(2):
        model(x).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()
    with ckpt.CheckpointManager(str(tmp_path), {"model": model, "optim": optim}) as manager:
        manager.save(2)
    saved = {k: {n: v.clone() for n, v in s.items()} for k, s in optim.state_dict()["state"].items()}

    model2, optim2 = build()
    model2(x).sum().backward()  # gradients on a never-stepped optimizer
    grads = [p.grad.clone() for p in model2.parameters()]
    with ckpt.CheckpointManager(str(tmp_path), {"model": model2, "optim": optim2}) as manager:
        assert manager.resume() == 2
    loaded = optim2.state_dict()["state"]
    assert sorted(loaded) == sorted(saved) and saved
    for index, entry in saved.items():
        for name, value in entry.items():
            assert torch.equal(loaded[index][name], value), (index, name)
    assert all(torch.equal(p.grad, g) for p, g in zip(model2.parameters(), grads, strict=True))
