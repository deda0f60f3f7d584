"""A start from step 0 says what it is: a new root, an empty one, a typo, or lost work.

The same line used to greet a new run, a typo in the root path and a torchrun restart
of a job that never saved; and a manager that saves nothing periodically under torchrun
restarts said nothing at all.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ckpt
from ckpt.loading.fresh_start import fresh_start_message, local_root_state, no_periodic_save_message
from ckpt.saving.policy import EverySeconds

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(120)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def _resume(root: str, caplog, monkeypatch, **env: str) -> list[str]:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    caplog.clear()
    with (
        caplog.at_level(logging.INFO, logger="ckpt.manager"),
        ckpt.CheckpointManager(root, {"model": torch.nn.Linear(2, 2)}) as manager,
    ):
        assert manager.resume() is None
    return _warnings(caplog)


def test_a_new_root_and_an_empty_existing_root_are_told_apart(tmp_path, caplog, monkeypatch):
    root = str(tmp_path / "run")
    said = _resume(root, caplog, monkeypatch)
    assert any("a new root: it did not exist" in m for m in said), said
    said = _resume(root, caplog, monkeypatch)  # the first manager created it
    assert any("the root exists but holds no committed checkpoint" in m for m in said), said


def test_a_typo_in_the_root_names_the_sibling_that_holds_checkpoints(tmp_path, caplog, monkeypatch):
    real = str(tmp_path / "experiment-1")
    with ckpt.CheckpointManager(real, {"model": torch.nn.Linear(2, 2)}) as manager:
        manager.save(4)
    said = _resume(str(tmp_path / "experimnet-1"), caplog, monkeypatch)
    assert any("did you mean" in m and real in m for m in said), said


def test_a_restart_that_finds_nothing_says_the_steps_before_the_failure_are_lost(
    tmp_path, caplog, monkeypatch
):
    said = _resume(str(tmp_path / "r"), caplog, monkeypatch, TORCHELASTIC_RESTART_COUNT="1")
    lost = [m for m in said if "restart 1 of the job" in m]
    assert lost and "are lost" in lost[0] and "every=0" in lost[0], said


def test_retention_is_said_once_per_job_not_at_every_restart(tmp_path, caplog, monkeypatch):
    said = _resume(str(tmp_path / "a"), caplog, monkeypatch)
    assert any("retention keeps the newest" in m for m in said), said
    said = _resume(str(tmp_path / "b"), caplog, monkeypatch, TORCHELASTIC_RESTART_COUNT="2")
    assert not any("retention keeps the newest" in m for m in said), said


def test_no_periodic_save_under_torchrun_restarts_is_said_at_start(tmp_path, caplog, monkeypatch):
    said = _resume(str(tmp_path / "a"), caplog, monkeypatch, TORCHELASTIC_MAX_RESTARTS="3")
    assert any("no periodic checkpoint (every=0)" in m and "3 time(s)" in m for m in said), said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckpt.manager"):
        ckpt.CheckpointManager(str(tmp_path / "b"), {"m": torch.nn.Linear(2, 2)}, every=5).close()
    assert not any("no periodic checkpoint" in m for m in _warnings(caplog))


@pytest.mark.parametrize(
    "options",
    [{"every_s": 60.0}, {"policy": EverySeconds(30.0)}],
    ids=["every_s", "policy"],
)
def test_saving_by_the_clock_or_a_policy_is_periodic(tmp_path, caplog, monkeypatch, options):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with caplog.at_level(logging.WARNING, logger="ckpt.manager"):
        opts = ckpt.CheckpointOptions(**options)
        ckpt.CheckpointManager(str(tmp_path), {"m": torch.nn.Linear(2, 2)}, options=opts).close()
    assert not any("no periodic checkpoint" in m for m in _warnings(caplog)), _warnings(caplog)
    assert "every_s=S" in no_periodic_save_message(3)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"restart_count": 2, "periodic": True, "root_existed": True, "siblings": []},
         "no save committed before the failure"),
        ({"restart_count": 0, "periodic": False, "root_existed": False, "siblings": ["/x/a"]},
         "did you mean /x/a?"),
        ({"restart_count": 0, "periodic": False, "root_existed": None, "siblings": []},
         "no committed checkpoint under R: starting from step 0"),
    ],
)  # fmt: skip
def test_fresh_start_message(kwargs, expected):
    assert expected in fresh_start_message("R", **kwargs)


def test_local_root_state_looks_only_beside_a_missing_root(tmp_path):
    (tmp_path / "run" / "checkpoint_0000002").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    assert local_root_state(str(tmp_path / "run")) == (True, [])
    assert local_root_state(str(tmp_path / "rnu")) == (False, [str(tmp_path / "run")])
    assert local_root_state(str(tmp_path / "nope" / "deeper")) == (False, [])


SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, ckpt
    import torch.distributed as dist
    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ckpt.CheckpointManager(sys.argv[1], {"model": model, "optim": opt}) as manager:
        start = manager.resume() or 0
        for step in range(start + 1, 6):
            model(torch.ones(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
            if step == 3 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
                os._exit(1)  # a crash before any save
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(240)
def test_under_torchrun_a_job_that_never_saves_is_warned_and_its_restart_says_what_was_lost(
    tmp_path,
):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    root = str(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
         "--max-restarts=1", "--monitor-interval=0.2", str(script), root],
        env=env, capture_output=True, text=True, timeout=200, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no periodic checkpoint (every=0) while torchrun may restart this job 1 time(s)" in (
        proc.stderr
    ), proc.stderr[-3000:]
    assert "restart 1 of the job: the steps trained before the failure are lost" in proc.stderr


def test_stock_dcp_checkpoints_are_named_as_such_by_ls_and_by_the_fresh_start(
    tmp_path, caplog, monkeypatch
):
    # What torchtitan (step-N) or a plain dcp.save (under our own directory name) wrote
    # is not ours to resume: it used to be listed as an interrupted save of ours (or not
    # at all), and the job trained from step 0 saying only "no committed checkpoint".
    import contextlib
    import io

    import torch.distributed.checkpoint as dcp

    import ckpt.cli

    root = tmp_path / "run"
    state = {"model": torch.nn.Linear(2, 2).state_dict()}
    for name in ("checkpoint_0000030", "step-40"):
        dcp.save(state, checkpoint_id=str(root / name), no_dist=True)
    (root / "step-50").mkdir()  # named like torchtitan's, empty: not a checkpoint at all

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert ckpt.cli.main(["ls", str(root)]) == 0
    rows = out.getvalue()
    assert "save interrupted" not in rows, rows
    lines = rows.splitlines()
    assert any(line.split()[:2] == ["30", "foreign"] and "stock DCP" in line for line in lines)
    assert any("step-40: a stock DCP checkpoint" in line for line in lines), rows
    assert "step-50" not in rows, rows

    said = _resume(str(root), caplog, monkeypatch)
    (line,) = [m for m in said if "no committed checkpoint" in m]
    assert "stock DCP checkpoints (step-40, checkpoint_0000030)" in line, line
    assert "python -m ckpt import DIR ROOT" in line, line
    # Nothing of them was touched.
    assert sorted(os.listdir(root / "step-40")) == sorted(os.listdir(root / "checkpoint_0000030"))

    # The other way in (docs/adoption.md): dcp.load into the state, then one save.
    model = torch.nn.Linear(2, 2)
    loaded = {"model": model.state_dict()}
    dcp.load(loaded, checkpoint_id=str(root / "step-40"), no_dist=True)
    model.load_state_dict(loaded["model"])
    with ckpt.CheckpointManager(str(root / "ours"), {"model": model}) as manager:
        manager.save(40)
    fresh = torch.nn.Linear(2, 2)
    with ckpt.CheckpointManager(str(root / "ours"), {"model": fresh}) as manager:
        assert manager.resume() == 40
    assert torch.equal(fresh.weight, state["model"]["weight"])
