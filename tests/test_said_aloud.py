"""Every decision a user must know about is said with no logging config at all.

A user's script (one process, the public API only, no ``logging.basicConfig``) is run
as a subprocess; its stderr must carry the fresh start, the policy that deletes old
checkpoints, the resume, the fallback past a damaged checkpoint, its quarantine and
the emergency checkpoint after SIGTERM (Python's last-resort handler prints WARNING
and above). Before, such a script printed nothing about any of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from test_ckpt_core import _corrupt_flip

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.timeout(180)

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import ckpt
    import elastic

    root, max_steps, faults = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = elastic.ElasticSampler(64, 8, seed=0)
    state = {"model": model, "optim": opt, "sampler": sampler}
    manager = ckpt.CheckpointManager(root, state, every=2)
    with manager, elastic.RunGuard(saver=manager, faults=faults, watchdog_s=0) as guard:
        start = manager.resume() or 0
        for step in guard.steps(start, max_steps):
            x = torch.randn(8, 8)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            sampler.advance()
            manager.maybe_save(step, final=step == max_steps)
    """
)


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = REPO
    env.pop("TRAINER_FAULTS", None)
    env.pop("CKPT_STORAGE_FAULTS", None)
    return subprocess.run(
        [sys.executable, script, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_script_without_logging_config_says_every_decision(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    root = str(tmp_path / "ckpt")

    first = run(str(script), root, "6")
    assert first.returncode == 0, first.stderr
    assert f"no committed checkpoint under {root}: starting from step 0" in first.stderr
    assert "retention keeps the newest 3 committed checkpoint(s)" in first.stderr

    _corrupt_flip(root, "checkpoint_0000006/rank_00000.distcp")

    second = run(str(script), root, "10", "sigterm:step=8")
    assert second.returncode == 143, second.stderr
    err = second.stderr
    assert "checkpoint_0000006" in err and "falling back to the previous one" in err
    assert "ckpt: quarantined" in err
    assert f"resumed step 4 from {root}/checkpoint_0000004" in err
    assert "emergency checkpoint committed at step 7" in err
    assert os.path.exists(os.path.join(root, "checkpoint_0000007", "COMPLETE"))


@pytest.mark.parametrize(
    ("env", "rank", "warns"),
    [
        ({"TORCHELASTIC_MAX_RESTARTS": "2"}, 0, True),
        ({"TORCHELASTIC_MAX_RESTARTS": "2"}, 1, False),  # rank 0 only: one line per job
        ({"TORCHELASTIC_MAX_RESTARTS": "2", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, 0, False),
        ({"TORCHELASTIC_MAX_RESTARTS": "0"}, 0, False),  # no restarts: nothing can hang
        ({}, 0, False),
    ],
)
def test_run_guard_says_the_restart_env_problem_on_rank_0(caplog, env, rank, warns):
    import elastic

    with (
        caplog.at_level("WARNING", logger="elastic.guard"),
        elastic.RunGuard(env=env, rank=rank, attempt=0, watchdog_s=0),
    ):
        pass
    lines = [r for r in caplog.records if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r.getMessage()]
    assert len(lines) == (1 if warns else 0)
    if warns:
        assert lines[0].levelname == "WARNING" and "restart" in lines[0].getMessage()
