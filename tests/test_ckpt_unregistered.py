"""An EMA copy the loop updates but left out of the state is said; registered, it resumes.

``ema = AveragedModel(model)`` updated every step and not in the manager's state used to
restart from the resumed weights after a resume (n_averaged 44 where the uninterrupted
run had 64), without a word.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.optim.swa_utils import AveragedModel

import ckpt
from ckpt.state.unregistered import UnregisteredModels, is_ema_like

pytestmark = pytest.mark.timeout(120)


def _train(model, opt, ema, steps):
    for _ in range(steps):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(model)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_an_ema_left_out_of_the_state_is_said_once_with_the_fix(tmp_path, caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = AveragedModel(model)
    caplog.set_level(logging.WARNING, logger="ckpt")
    with ckpt.CheckpointManager(str(tmp_path / "c"), {"model": model, "optim": opt}) as manager:
        for step in (1, 2, 3):
            _train(model, opt, ema, 2)
            manager.save(step)
    said = [m for m in _warnings(caplog) if "AveragedModel" in m]
    assert len(said) == 1, _warnings(caplog)
    assert "not in the checkpoint state" in said[0] and '"ema": ema' in said[0]


def test_a_registered_ema_is_not_said_and_resumes_its_average(tmp_path, caplog):
    root = str(tmp_path / "c")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = AveragedModel(model)
    caplog.set_level(logging.WARNING, logger="ckpt")
    state = {"model": model, "optim": opt, "ema": ema}
    with ckpt.CheckpointManager(root, state) as manager:
        for step in (1, 2):
            _train(model, opt, ema, 2)
            manager.save(step)
    assert not [m for m in _warnings(caplog) if "not in the checkpoint state" in m]
    saved = {k: v.clone() for k, v in ema.state_dict().items()}

    torch.manual_seed(1)
    model2 = torch.nn.Linear(4, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    ema2 = AveragedModel(model2)
    with ckpt.CheckpointManager(root, {"model": model2, "optim": opt2, "ema": ema2}) as m2:
        assert m2.resume() == 2
    assert int(ema2.n_averaged) == 4
    for key, value in ema2.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_a_frozen_copy_or_an_ordinary_module_is_not_taken_for_an_ema():
    model = torch.nn.Linear(4, 2)
    frozen = AveragedModel(model)  # never updated between the two saves
    teacher = torch.nn.Linear(4, 2)  # not EMA-like, whatever it does
    watch = UnregisteredModels()
    assert watch.observe([model]) == []
    with torch.no_grad():
        teacher.weight.add_(1.0)
        model.weight.add_(1.0)
    assert watch.observe([model]) == []
    assert is_ema_like(frozen) and not is_ema_like(teacher)
