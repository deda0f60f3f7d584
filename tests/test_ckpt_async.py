"""Asynchronous saves: staged copy, background commit, one in flight, errors surfaced, 2 ranks."""

from __future__ import annotations

import time

import pytest
import torch

import ckpt
from ckpt.format.layout import COMPLETE_NAME, checkpoint_dirname
from ckpt.storage import Storage, faults
from ckpt.storage.faults import StorageFault
from testing.spawn import run_ok

pytestmark = pytest.mark.timeout(120)

DELAY_S = 1.5


@pytest.fixture(autouse=True)
def _drain_async_saves():
    """No test leaves a save in flight (or an unobserved error) to the next one."""
    yield
    try:
        ckpt.close(timeout=60)
    except Exception:
        pass


def make_state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen)},
        "optim": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
        "step": seed,
        "name": f"run-{seed}",
    }


def blank_state() -> dict:
    return {
        "model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)},
        "optim": {"state": {0: {"step": torch.tensor(0.0)}}, "param_groups": [{"lr": 0.0}]},
        "step": -1,
        "name": "",
    }


def clone_state(state: dict) -> dict:
    return ckpt.saving.async_save.stage_state(state)


def has_complete(root: str, step: int) -> bool:
    return COMPLETE_NAME in Storage(root).child(checkpoint_dirname(step)).list_files()


def test_async_save_returns_after_staging_and_commits_the_staged_values(memory_root):
    state = make_state(7)
    expected = clone_state(state)
    events: list[dict] = []
    with faults.inject(StorageFault(phase="shard", kind="delay", delay_s=DELAY_S)) as injected:
        started = time.monotonic()
        pending = ckpt.save(state, memory_root, 7, async_save=True, on_event=events.append)
        blocked = time.monotonic() - started
        assert isinstance(pending, ckpt.PendingSave)
        assert (pending.step, pending.url) == (7, f"{memory_root}/checkpoint_0000007")
        # The upload is still sleeping in the shard write: nothing is committed yet.
        assert blocked < DELAY_S / 2, blocked
        assert not pending.done()
        assert not has_complete(memory_root, 7)
        assert events == []
        # The caller trains on right away, changing its tensors in place.
        state["model"]["w"].add_(100.0)
        state["model"]["b"].zero_()
        state["optim"]["state"][0]["step"].fill_(99.0)
        state["optim"]["param_groups"][0]["lr"] = 9.0
        state["step"] = 8
        url = pending.wait(timeout=60)
        assert injected[0].fired == 1
    total = time.monotonic() - started
    assert url == pending.url and pending.done() and has_complete(memory_root, 7)
    assert total >= DELAY_S
    [event] = events
    assert event["event"] == "ckpt_saved" and event["async"] is True
    assert event["blocking_s"] < DELAY_S / 2 <= event["duration_s"]

    loaded = blank_state()
    result = ckpt.load(loaded, memory_root)
    assert result.step == 7
    assert torch.equal(loaded["model"]["w"], expected["model"]["w"])
    assert torch.equal(loaded["model"]["b"], expected["model"]["b"])
    assert loaded["optim"]["state"][0]["step"].item() == 3.0
    assert loaded["optim"]["param_groups"][0]["lr"] == 0.1
    assert (loaded["step"], loaded["name"]) == (7, "run-7")


def test_staging_reuses_buffers_of_the_same_shape():
    state = make_state(1)
    first = ckpt.saving.async_save.stage_state(state)
    assert first["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()
    state["model"]["w"].add_(1.0)
    second = ckpt.saving.async_save.stage_state(state, reuse=first)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()
    assert torch.equal(second["model"]["w"], state["model"]["w"])
    state["model"]["w"] = torch.zeros(3)  # new shape: a new buffer
    third = ckpt.saving.async_save.stage_state(state, reuse=second)
    assert third["model"]["w"].shape == (3,)


def test_failed_background_save_raises_at_wait_next_save_and_close(memory_root):
    state = make_state(1)
    # Failure seen through the handle: raised by wait(), then not again.
    with faults.inject(StorageFault(phase="shard", kind="permanent")):
        pending = ckpt.save(state, memory_root, 1, async_save=True)
        with pytest.raises(ckpt.CheckpointError, match="step 1"):
            pending.wait(timeout=60)
    with pytest.raises(ckpt.CheckpointError):
        pending.wait(timeout=1)  # the handle keeps its outcome
    assert not has_complete(memory_root, 1)
    assert ckpt.save(state, memory_root, 2) == f"{memory_root}/checkpoint_0000002"

    # Failure nobody waited for: raised by the next save, which does not run.
    with faults.inject(StorageFault(phase="complete", kind="permanent")):
        pending = ckpt.save(state, memory_root, 3, async_save=True)
        while not pending.done():
            time.sleep(0.01)
    with pytest.raises(ckpt.CheckpointError) as excinfo:
        ckpt.save(state, memory_root, 4, async_save=True)
    assert any("step 3" in note for note in excinfo.value.__notes__)
    assert not has_complete(memory_root, 3) and not has_complete(memory_root, 4)
    # Raised once: the next save goes through.
    assert ckpt.save(state, memory_root, 4, async_save=True).wait(timeout=60)
    assert has_complete(memory_root, 4)

    # ... or by close() at exit.
    with faults.inject(StorageFault(phase="shard", kind="permanent")):
        ckpt.save(state, memory_root, 5, async_save=True)
        with pytest.raises(ckpt.CheckpointError):
            ckpt.close(timeout=60)
    assert ckpt.close(timeout=1) is None
    assert not has_complete(memory_root, 5)
    assert [c.step for c in ckpt.list_checkpoints(memory_root) if c.committed] == [4, 2]


def test_at_most_one_save_in_flight(memory_root):
    state = make_state(2)
    with faults.inject(StorageFault(phase="shard", kind="delay", delay_s=DELAY_S)):
        started = time.monotonic()
        first = ckpt.save(state, memory_root, 1, async_save=True)
        first_blocked = time.monotonic() - started
        assert first_blocked < DELAY_S / 2 and not first.done()
        second = ckpt.save(state, memory_root, 2, async_save=True)
        second_returned = time.monotonic() - started
        # The second save waited for the first one's upload before staging.
        assert first.done() and has_complete(memory_root, 1)
        assert second_returned >= DELAY_S * 0.9
        assert second.blocking_s < DELAY_S / 2  # its own staging was quick
        assert ckpt.wait_pending(timeout=60) == second.url
    assert has_complete(memory_root, 2)


def async_training_worker(rank: int, world: int, root: str, delay_s: float) -> dict:
    import torch.distributed as dist
    from test_ckpt_distributed import build, full_state, sharded_state, train_steps

    model, optim = build(seed=11)
    train_steps(model, optim, 2, rank)
    at_save = full_state(model, optim)
    faults.install(StorageFault(phase="shard", kind="delay", delay_s=delay_s))
    started = time.monotonic()
    pending = ckpt.save(sharded_state(model, optim, 2), root, 2, async_save=True)
    blocked = time.monotonic() - started
    steps_while_saving = 0
    while True:  # decided jointly below: both ranks must call all_reduce equally often
        train_steps(model, optim, 1, rank + 10 * steps_while_saving)
        flag = torch.tensor([1.0])
        dist.all_reduce(flag)  # a training collective on the default group
        assert flag.item() == world
        steps_while_saving += 1
        done = torch.tensor([1.0 if pending.done() else 0.0])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item() == 1.0:
            break
    url = pending.wait(timeout=60)
    ckpt.close()
    after = full_state(model, optim)

    fresh, fresh_optim = build(seed=999)
    train_steps(fresh, fresh_optim, 1, rank)
    state = sharded_state(fresh, fresh_optim, step=-1)
    result = ckpt.load(state, root)
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        fresh, fresh_optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    loaded = full_state(fresh, fresh_optim)
    return {
        "url": url,
        "blocked": blocked,
        "steps_while_saving": steps_while_saving,
        "loaded_step": result.step,
        "step_value": state["step"],
        "at_save": at_save,
        "after": after,
        "loaded": loaded,
    }


@pytest.mark.timeout(300)
def test_two_ranks_train_while_the_previous_step_uploads(tmp_root):
    delay_s = 3.0
    results = run_ok(async_training_worker, 2, tmp_root, delay_s, timeout_s=240)
    for out in results:
        assert out["url"].endswith("checkpoint_0000002")
        assert out["blocked"] < delay_s / 2, out["blocked"]
        assert out["steps_while_saving"] >= 1
        assert (out["loaded_step"], out["step_value"]) == (2, 2)
        at_save, loaded = out["at_save"], out["loaded"]
        assert set(at_save) == set(loaded)
        for key in at_save:
            assert torch.equal(at_save[key], loaded[key]), key
        # Training really changed the parameters after the save step.
        assert any(not torch.equal(at_save[k], out["after"][k]) for k in at_save)


def _slow_copies(monkeypatch, delay_s: float) -> None:
    real = ckpt.saving.async_save._run_copies

    def slow(copies):
        time.sleep(delay_s)  # the background copy starts late: the race is real
        real(copies)

    monkeypatch.setattr(ckpt.saving.async_save, "_run_copies", slow)


def test_overlap_staging_gates_the_optimizer_step_until_copied(memory_root, monkeypatch):
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _slow_copies(monkeypatch, DELAY_S)

    started = time.monotonic()
    pending = ckpt.save(
        {"model": model.state_dict()}, memory_root, 1, async_save=True, overlap_staging=opt
    )
    # The copy did not run in the call: it returns in milliseconds, a copy in it would
    # hold it for at least DELAY_S (half of that is a loose bound for a loaded machine).
    assert time.monotonic() - started < DELAY_S / 2
    assert not pending.staged()
    model(torch.ones(2, 16)).sum().backward()  # forward/backward overlap the copy
    opt.step()  # changes every parameter in place: must wait for the copy
    assert pending.staged()
    assert pending.gate_wait_s > 0.1
    assert pending.wait(timeout=60)

    blank = {"model": {k: torch.zeros_like(v) for k, v in before.items()}}
    ckpt.load(blank, memory_root)
    for key, value in before.items():
        assert torch.equal(blank["model"][key], value), key  # the pre-step values
        assert not torch.equal(model.state_dict()[key], value)  # the step did change them


def test_overlap_staging_hooks_are_removed_by_the_next_save_and_close(memory_root):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2):
        ckpt.save(
            {"m": model.state_dict()}, memory_root, step, async_save=True, overlap_staging=[opt]
        )
        assert len(opt._optimizer_step_pre_hooks) == 1
    ckpt.close(timeout=60)
    assert len(opt._optimizer_step_pre_hooks) == 0


def test_overlap_staging_argument_errors(memory_root):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="async_save=True"):
        ckpt.save(
            {"m": model.state_dict()},
            memory_root,
            1,
            overlap_staging=torch.optim.SGD(model.parameters(), lr=0.1),
        )
    with pytest.raises(TypeError, match="Optimizer"):
        ckpt.save({"m": model.state_dict()}, memory_root, 1, async_save=True, overlap_staging=model)
    assert not ckpt.list_checkpoints(memory_root)
