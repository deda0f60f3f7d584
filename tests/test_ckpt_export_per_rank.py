"""Export of a user's DDP model with BatchNorm and an EMA copy (AveragedModel), 2 ranks.

BatchNorm statistics differ between DDP ranks (each normalizes its own batches), so the
manager saves them per rank; an export that reads only the shared tensors dropped all of
them without a word, and ``--model-key ema`` kept AveragedModel's ``module.`` names and
its ``n_averaged``. Real processes on gloo (``testing.spawn``), the public API only.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import ckpt
import ckpt.errors
from ckpt.interop.export import export
from testing.spawn import run_ok

pytestmark = pytest.mark.timeout(300)


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    )  # fmt: skip


def _train_and_save(rank: int, world: int, root: str) -> dict:
    from torch.optim.swa_utils import AveragedModel

    model = nn.parallel.DistributedDataParallel(_cnn())
    ema = AveragedModel(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with ckpt.CheckpointManager(root, {"model": model, "optim": optim, "ema": ema}) as manager:
        for step in (1, 2, 3):
            gen = torch.Generator().manual_seed(100 * rank + step)
            x = torch.randn(5, 1, 6, 6, generator=gen) * (1 + rank)  # ranks see other data
            model(x).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
            ema.update_parameters(model)
        manager.save(3, blocking=True)
    return {
        "model": {k: v.clone() for k, v in model.module.state_dict().items()},
        "ema": {k: v.clone() for k, v in ema.module.module.state_dict().items()},
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ddp-bn-ema") / "ckpt")
    states = run_ok(_train_and_save, 2, root)
    assert not torch.equal(
        states[0]["model"]["1.running_mean"], states[1]["model"]["1.running_mean"]
    ), "the ranks' BatchNorm statistics must differ for this test to mean anything"
    return root, states


def _load_plain(path: str) -> nn.Module:
    from safetensors.torch import load_file

    module = _cnn()
    module.load_state_dict(load_file(f"{path}/model.safetensors"), strict=True)
    return module.eval()


def _eval_equal(module: nn.Module, reference: dict) -> None:
    expected = _cnn()
    expected.load_state_dict(reference, strict=True)
    x = torch.randn(7, 1, 6, 6, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(module(x), expected.eval()(x))


def test_export_of_a_ddp_model_keeps_its_batchnorm_stats_from_rank_0_and_says_so(
    saved, tmp_path, caplog
):
    root, states = saved
    caplog.set_level(logging.WARNING, logger="ckpt")
    result = export(root, str(tmp_path / "model"))
    module = _load_plain(str(tmp_path / "model"))  # strict: nothing missing
    _eval_equal(module, states[0]["model"])
    assert sorted(result.per_rank) == ["1.running_mean", "1.running_var"]
    assert result.per_rank_source == "rank 0"
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("differ between ranks" in m and "1.running_mean" in m for m in said), said


def test_another_rank_or_the_mean_of_the_ranks_copies_on_request(saved, tmp_path):
    root, states = saved
    export(root, str(tmp_path / "r1"), rank=1)
    _eval_equal(_load_plain(str(tmp_path / "r1")), states[1]["model"])
    result = export(root, str(tmp_path / "mean"), rank="mean")
    assert result.per_rank_source == "mean of 2 ranks"
    got = _load_plain(str(tmp_path / "mean")).state_dict()
    for name in ("1.running_mean", "1.running_var"):
        expected = (states[0]["model"][name].double() + states[1]["model"][name].double()) / 2
        assert torch.equal(got[name], expected.float())
    with pytest.raises(ckpt.errors.ExportError, match="holds ranks 0, 1"):
        export(root, str(tmp_path / "r5"), rank=5)


def test_an_averaged_model_exports_as_the_plain_module_with_its_stats(saved, tmp_path, caplog):
    root, states = saved
    caplog.set_level(logging.WARNING, logger="ckpt")
    result = export(root, str(tmp_path / "ema"), model_key="ema")
    assert result.unwrapped == "AveragedModel"
    _eval_equal(_load_plain(str(tmp_path / "ema")), states[0]["ema"])
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "AveragedModel" in said and "n_averaged" in said
    kept = export(root, str(tmp_path / "ema-raw"), model_key="ema", unwrap=False)
    assert kept.unwrapped == "" and kept.tensors == result.tensors + 1  # n_averaged too


def test_the_cli_takes_rank_and_keep_wrapper_names(saved, tmp_path, capsys):
    from ckpt.cli import main

    root, states = saved
    assert main(["export", root, str(tmp_path / "cli"), "--rank", "1"]) == 0
    assert "per rank 2 tensor(s) from rank 1" in capsys.readouterr().out
    _eval_equal(_load_plain(str(tmp_path / "cli")), states[1]["model"])
    with pytest.raises(SystemExit):
        main(["export", root, str(tmp_path / "bad"), "--rank", "first"])
