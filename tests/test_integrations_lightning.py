"""``integrations.lightning.ElasticCheckpoints`` in one process (the torchrun kills and the
2 -> 1 resume are in tests/e2e/test_lightning_e2e.py)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os

import pytest
import pytorch_lightning as pl  # the test extra installs it
import torch

import elastic
from ckpt import list_checkpoints
from integrations.lightning import ElasticCheckpoints
from testing.local_cluster import REPO


def example():
    spec = importlib.util.spec_from_file_location(
        "lightning_fit", os.path.join(REPO, "examples", "lightning_fit.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fit(tmp_path, root, *, max_steps=-1, max_epochs=None, sampler=True, checkpointing=False,
        every=4, run="run", loader=None, callbacks=(), fit_kwargs=None, model=None,
        **callback_kwargs):  # fmt: skip
    """The example's model and data in this process; returns (callback, losses by step).

    ``sampler``: the callback is given the sampler (and the fit its epoch loader unless
    ``loader`` says "plain" or "epoch")."""
    ex = example()
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    dataset = torch.utils.data.TensorDataset(x, x.sum(-1))
    model = ex.Regressor() if model is None else model
    fit.last_model = model
    model.metrics_path = str(tmp_path / f"{run}.jsonl")
    elastic_sampler = elastic.ElasticSampler(len(dataset), 8, seed=0, rank=0, world_size=1)
    callback = ElasticCheckpoints(
        str(root), every=every, sampler=elastic_sampler if sampler else None, **callback_kwargs
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=max_epochs,
        callbacks=[callback, *callbacks], enable_checkpointing=checkpointing, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), use_distributed_sampler=False,
    )  # fmt: skip
    if loader is None:
        loader = "epoch" if sampler else "plain"
    data = (
        elastic_sampler.epoch_loader(dataset)
        if loader == "epoch"
        else torch.utils.data.DataLoader(dataset, batch_size=8)
    )
    trainer.fit(model, train_dataloaders=data, **(fit_kwargs or {}))
    with open(model.metrics_path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    return callback, {r["step"]: r["loss"] for r in rows}


@pytest.mark.timeout(180)
def test_a_second_fit_resumes_mid_epoch_and_matches_one_fit_bitwise(tmp_path):
    """12 steps then a new Trainer to 20 (8 batches an epoch: step 12 is mid-epoch two)
    equals 20 steps in one fit: model, AdamW, StepLR, Lightning's loop, the sampler and the
    dropout RNG all came back."""
    _, whole = fit(tmp_path, tmp_path / "whole", max_steps=20, run="whole")
    first, part = fit(tmp_path, tmp_path / "parts", max_steps=12, run="parts")
    assert sorted(part) == list(range(1, 13))
    assert first.resumed_step is None
    second, rest = fit(tmp_path, tmp_path / "parts", max_steps=20, run="parts")
    assert second.resumed_step == 12
    assert sorted(rest) == list(range(1, 21))  # one file: steps 13-20 appended
    assert rest == whole
    assert list_checkpoints(str(tmp_path / "parts"))[0].step == 20  # newest first


@pytest.mark.timeout(180)
def test_a_second_fit_of_the_same_module_in_one_process_resumes_bitwise(tmp_path):
    """fit to 12, then fit the same module again to 20 in this process: the gradients the
    first fit left on its parameters do not keep the new AdamW's state from loading."""
    _, whole = fit(tmp_path, tmp_path / "whole", max_steps=20, run="whole")
    fit(tmp_path, tmp_path / "parts", max_steps=12, run="parts")
    module = fit.last_model
    assert any(p.grad is not None for p in module.parameters())
    second, rest = fit(tmp_path, tmp_path / "parts", max_steps=20, run="parts", model=module)
    assert second.resumed_step == 12
    assert rest == whole


@pytest.mark.timeout(180)
def test_a_fit_ended_by_max_epochs_ends_on_a_commit_of_its_last_step(tmp_path):
    callback, rows = fit(tmp_path, tmp_path / "root", max_epochs=2, every=1000)
    assert max(rows) == 16  # 2 epochs of 8 batches
    assert [c.step for c in list_checkpoints(str(tmp_path / "root"))] == [16]
    assert callback.manager is None  # closed at teardown


@pytest.mark.timeout(180)
def test_what_lightning_keeps_and_the_state_does_not_is_said_at_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="integrations.lightning"):
        fit(tmp_path, tmp_path / "root", max_steps=2, sampler=False, checkpointing=True)
    said = " | ".join(r.getMessage() for r in caplog.records if r.name == "integrations.lightning")
    assert "ModelCheckpoint is on" in said and "enable_checkpointing=False" in said, said
    assert "no sampler given: the data position is not checkpointed" in said, said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="integrations.lightning"):
        fit(tmp_path, tmp_path / "root2", max_steps=2, run="quiet")
    assert [r for r in caplog.records if r.name == "integrations.lightning"] == []


def test_extra_state_may_not_take_a_name_the_lightning_state_uses(tmp_path):
    callback = ElasticCheckpoints(str(tmp_path), extra_state={"model": 1})
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    with pytest.raises(ValueError, match=r"extra_state names \['model'\]"):
        callback.state_of(trainer, example().Regressor())


@pytest.mark.timeout(180)
def test_another_callbacks_state_given_in_extra_state_resumes_and_is_not_said(tmp_path, caplog):
    """The WARNING's advice, followed: EarlyStopping's state (best_score starts at inf, so
    its key is allowed non-finite) in extra_state is checkpointed, and no longer said."""
    stop = pl.callbacks.EarlyStopping(monitor="never_logged", check_on_train_epoch_end=False)
    with caplog.at_level(logging.WARNING, logger="integrations.lightning"):
        fit(tmp_path, tmp_path / "root", max_steps=4, callbacks=[stop],
            extra_state={"early_stop": stop},
            allow_non_finite=("early_stop.*",))  # fmt: skip
    said = [r.getMessage() for r in caplog.records if r.name == "integrations.lightning"]
    assert said == []
    assert list_checkpoints(str(tmp_path / "root"))[0].step == 4
    stop2 = pl.callbacks.EarlyStopping(monitor="never_logged", check_on_train_epoch_end=False)
    stop2.wait_count = 7  # overwritten by the resume
    fit(tmp_path, tmp_path / "root", max_steps=6, callbacks=[stop2],
        extra_state={"early_stop": stop2}, allow_non_finite=("early_stop.*",))  # fmt: skip
    assert stop2.wait_count == 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "how, message",
    [
        ("ckpt_path", "drop ckpt_path"),
        ("plain_loader", r"train on sampler\.epoch_loader"),
        ("no_sampler", "was given no sampler: pass sampler="),
    ],
)
def test_what_would_train_on_the_wrong_state_is_refused_before_the_first_step(
    tmp_path, how, message
):
    root = tmp_path / "root"
    if how == "ckpt_path":
        fit(tmp_path, root, max_steps=4, checkpointing=True)  # ours and Lightning's .ckpt
        (lightning_ckpt,) = (tmp_path / "checkpoints").glob("*.ckpt")
        kwargs = {"fit_kwargs": {"ckpt_path": str(lightning_ckpt)}, "run": "again"}
    elif how == "plain_loader":
        kwargs = {"loader": "plain"}
    else:
        kwargs = {"sampler": False, "loader": "epoch"}
    with pytest.raises(ValueError, match=message):
        fit(tmp_path, root, max_steps=8, **kwargs)
    assert not (tmp_path / f"{kwargs.get('run', 'run')}.jsonl").exists() or how == "ckpt_path"
    if how == "ckpt_path":  # nothing trained on, nothing committed past step 4
        assert [c.step for c in list_checkpoints(str(root))] == [4]
