"""A committed checkpoint whose manager record has the wrong types is never used.

A resume computes its load template from the manifest's manager record before it reads
a tensor; ``fresh_optimizers: 7``, ``shapes: [1, 2]`` or ``world_size: 0`` (a COMPLETE
that vouches for the forged manifest, as an attacker or a bug would leave it) used to
raise TypeError/AttributeError/ZeroDivisionError out of every attempt of the job, with
nothing quarantined, and ``verify`` said OK. Now discovery calls such a checkpoint
damaged: ``verify`` fails it, a resume sets it aside and loads the previous one.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from corpus import rewrite_manifest

import ckpt
from ckpt import cli
from ckpt.format.manager_record import record_problems

pytestmark = pytest.mark.timeout(120)


def _two_checkpoints(root: str) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    with ckpt.CheckpointManager(root, {"model": model, "optim": opt}) as manager:
        for step in (1, 2):
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
            manager.save(step)
            if step == 1:
                at_one = {k: v.clone() for k, v in model.state_dict().items()}
    return model, at_one


def _forge(root: str, step: int, change) -> None:
    directory = os.path.join(root, next(d for d in os.listdir(root) if d.endswith(f"{step:07d}")))
    with open(os.path.join(directory, "manifest.json")) as fh:
        data = json.load(fh)
    change(data)
    rewrite_manifest(directory, data)


def _record(data: dict) -> dict:
    return data["metadata"]["ckpt_manager"]


FORGERIES = {
    "fresh_optimizers is a number": lambda d: _record(d).update(fresh_optimizers=7),
    "shapes is a list": lambda d: _record(d).update(shapes=[1, 2]),
    "per_rank is a string": lambda d: _record(d).update(per_rank="model/weight"),
    "the record is a list": lambda d: d["metadata"].update(ckpt_manager=[1]),
    "world_size is 0": lambda d: d.update(world_size=0),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_malformed_manager_record_fails_verify_and_a_resume_falls_back(tmp_path, forgery):
    root = str(tmp_path / "ckpt")
    _, at_one = _two_checkpoints(root)
    _forge(root, 2, FORGERIES[forgery])

    assert cli.main(["verify", root]) == 1  # the newest commit is damaged: FAIL, not OK

    torch.manual_seed(5)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    with ckpt.CheckpointManager(root, {"model": model, "optim": opt}) as manager:
        assert manager.resume() == 1
    for name, value in model.state_dict().items():
        assert torch.equal(value, at_one[name]), name
    assert any(".quarantined-" in name for name in os.listdir(root))


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({}, []),
        ({"ckpt_manager": {"keys": ["model"], "shapes": {"model": {"w": [2, 3]}}}}, []),
        ({"ckpt_manager": {"shapes": {"model": {"w": [2, -1]}}}}, ["'shapes'"]),
        ({"ckpt_manager": {"rng": "yes", "tied": {"model": {"a": 1}}}}, ["'rng'", "'tied'"]),
        ({"ckpt_manager": {"tied": {"model": {"lm_head.weight": "embed.weight"}}}}, []),
        ({"ckpt_manager": "x"}, ["not a mapping"]),
    ],
)
def test_record_problems(metadata, expected):
    problems = record_problems(metadata)
    assert len(problems) == len(expected)
    for problem, word in zip(problems, expected):
        assert word in problem


# -- declared sizes are tied to stored bytes ------------------------------------------------


def test_a_stride_0_item_that_declares_more_bytes_than_it_stores_is_refused_everywhere(
    tmp_path, monkeypatch
):
    from ckpt.saving import writer

    root = str(tmp_path / "ckpt")
    monkeypatch.setattr(writer, "own_storage", lambda tensor: tensor)  # keep the stride 0
    ckpt.save({"w": torch.ones(1).expand(2048, 2048)}, root, 1)  # 16 MiB declared
    monkeypatch.undo()
    shard = next(
        os.path.join(dirpath, f)
        for dirpath, _, files in os.walk(root)
        for f in files
        if f.endswith(".distcp")
    )
    assert os.path.getsize(shard) < 64 << 10  # the 7 KB checkpoint of the report

    assert cli.main(["verify", root]) == 1
    assert cli.main(["verify", "--deep", root]) == 1
    out = tmp_path / "export"
    with pytest.raises(ckpt.CheckpointError, match=r"declares \d+ bytes of data"):
        ckpt.export(root, str(out), model_key="w")
    assert not out.exists() and not any(p.name.startswith("export") for p in tmp_path.iterdir())
    target = {"w": torch.zeros(2048, 2048)}
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load(target, root)
    assert float(target["w"].sum()) == 0.0  # nothing was written into it


# -- what is printed from a root is escaped, malformed fields print as such ----------------


ESC = "\x1b]0;owned\x07\x1b[31m"


def test_inspect_and_gc_escape_what_they_print_and_survive_malformed_fields(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    _two_checkpoints(root)

    def forge(data: dict) -> None:
        data.update(created_at=ESC, torch_version=ESC, membership=[1, {"host": ESC}, "x"])
        data["attempt"]["run_id"] = ESC
        data["metadata"]["ckpt_manager"]["data_position"] = {ESC: 5}

    _forge(root, 2, forge)
    assert cli.main(["inspect", root]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b" in out and "(malformed: 5)" in out

    aside = os.path.join(root, "checkpoint_0000001.quarantined-20260101T000000Z")
    os.rename(os.path.join(root, "checkpoint_0000001"), aside)
    with open(os.path.join(aside, f"notes{ESC}.txt"), "w") as fh:
        fh.write("a user's file")
    assert cli.main(["gc", root, "--quarantined"]) == 0
    out = capsys.readouterr().out
    assert "left alone" in out and "\x1b" not in out and "\x07" not in out
