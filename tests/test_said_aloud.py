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


def run(
    script: str, *args: str, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = REPO
    env.pop("TRAINER_FAULTS", None)
    env.pop("CKPT_STORAGE_FAULTS", None)
    env.update(env_extra or {})
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


# -- mistakes that used to be silent -------------------------------------------------------

FORGETFUL_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import ckpt
    import elastic

    root = sys.argv[1]
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    sampler = elastic.ElasticSampler(64, 8, seed=0)
    manager = ckpt.CheckpointManager(root, {"model": model, "optim": opt}, every=2)
    with manager:
        for step in range(1, 6):
            model(torch.randn(8, 8)).sum().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            sampler.advance()
            manager.maybe_save(step, final=step == 4)  # one step too many after the final save
    """
)


@pytest.fixture(scope="module")
def forgetful(tmp_path_factory) -> subprocess.CompletedProcess:
    """A script that keeps its scheduler and sampler out of the state and steps past its
    final save (one run, three warnings)."""
    tmp = tmp_path_factory.mktemp("forgetful")
    script = tmp / "forgetful.py"
    script.write_text(FORGETFUL_SCRIPT)
    result = run(str(script), str(tmp / "ckpt"))
    assert result.returncode == 0, result.stderr
    return result


def test_an_lr_scheduler_left_out_of_the_state_is_said_when_the_manager_is_built(forgetful):
    assert "state['optim'] is stepped by an LR scheduler that is not in the" in forgetful.stderr
    assert "its schedule (warm-up included) starts over" in forgetful.stderr


def test_a_sampler_left_out_of_the_state_is_said_at_the_first_save(forgetful):
    lines = [li for li in forgetful.stderr.splitlines() if "in no checkpoint manager's" in li]
    assert len(lines) == 1, forgetful.stderr  # the first save only
    assert "step 2: an ElasticSampler at sample cursor 16" in lines[0]


def test_a_loop_that_goes_on_after_its_final_save_is_said_at_the_next_step(forgetful):
    assert "step 5: training goes on after the final save at step 4" in forgetful.stderr


NO_FINAL_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import ckpt

    root, fail = sys.argv[1], sys.argv[2] == "fail"
    model = torch.nn.Linear(8, 2)
    with ckpt.CheckpointManager(root, {"model": model}, every=4) as manager:
        for step in range(1, 11):
            manager.maybe_save(step)  # no final=: steps 9 and 10 are never saved
        if fail:
            raise RuntimeError("boom")
    """
)


def test_a_loop_that_never_saves_its_last_steps_is_said_at_close(tmp_path, forgetful):
    script = tmp_path / "no_final.py"
    script.write_text(NO_FINAL_SCRIPT)
    done = run(str(script), str(tmp_path / "ckpt"), "ok")
    assert done.returncode == 0, done.stderr
    assert "closing after step 10, but the newest checkpoint is step 8" in done.stderr
    assert "final=True" in done.stderr
    failed = run(str(script), str(tmp_path / "ckpt2"), "fail")  # an error on the way out
    assert failed.returncode != 0 and "boom" in failed.stderr
    assert "closing after step" not in failed.stderr
    assert "closing after step" not in forgetful.stderr  # it passed final=True


LR_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import ckpt

    root, lr, keep = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "keep"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    manager = ckpt.CheckpointManager(
        root, {"model": model, "optim": opt}, param_groups="constructed" if keep else "checkpoint"
    )
    with manager:
        start = manager.resume() or 0
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        manager.maybe_save(start + 1, final=True)
    print("lr", opt.param_groups[0]["lr"])
    """
)


def test_a_changed_lr_replaced_by_the_checkpoints_is_said_and_can_be_kept(tmp_path):
    script = tmp_path / "lr.py"
    script.write_text(LR_SCRIPT)
    root = str(tmp_path / "ckpt")
    assert run(str(script), root, "0.001", "no").returncode == 0

    replaced = run(str(script), root, "0.005", "no")
    assert replaced.returncode == 0, replaced.stderr
    assert "lr 0.001" in replaced.stdout  # standard PyTorch: the checkpoint's value wins...
    assert "the checkpoint's optimizer settings replace" in replaced.stderr  # ...said aloud
    assert "optim group 0: lr 0.005 (constructed) -> 0.001 (checkpoint)" in replaced.stderr
    assert 'param_groups="constructed"' in replaced.stderr  # and how to keep the new one

    kept = run(str(script), root, "0.005", "keep")
    assert kept.returncode == 0, kept.stderr
    assert "lr 0.005" in kept.stdout
    assert "keeping the optimizer settings this run was built with" in kept.stderr


DDP_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ckpt

    root, width, init = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2)))
    manager = ckpt.CheckpointManager(root, {"model": model})
    try:
        with manager:
            manager.resume()
            manager.maybe_save(1, final=True)
    except ckpt.CheckpointShapeError as exc:
        print("ERROR", exc)
    dist.destroy_process_group()
    """
)


def test_a_shape_error_names_tensors_as_the_users_module_and_the_checkpoint_do(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    root = str(tmp_path / "ckpt")
    first = run(str(script), root, "8", str(tmp_path / "init1"))
    assert first.returncode == 0 and "ERROR" not in first.stdout, first.stderr
    second = run(str(script), root, "16", str(tmp_path / "init2"))
    assert second.returncode == 0, second.stderr
    error = next(li for li in second.stdout.splitlines() if li.startswith("ERROR"))
    assert "tensor '0.weight' has shape [8, 4] in the checkpoint but [16, 4]" in error
    assert "module." not in error  # DDP's wrapper name: neither the user's nor the stored one


def test_export_without_a_config_says_from_pretrained_needs_one_and_how(tmp_path):
    root = str(tmp_path / "ckpt")
    with ckpt_manager(root) as manager:
        manager.maybe_save(1, final=True)
    out = str(tmp_path / "out")
    result = subprocess.run(
        [sys.executable, "-m", "ckpt", "export", root, out],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "gets no config.json: transformers' from_pretrained needs one" in result.stderr
    assert "--config config.json" in result.stderr
    assert not os.path.exists(os.path.join(out, "config.json"))


def ckpt_manager(root: str):
    import torch

    import ckpt

    return ckpt.CheckpointManager(root, {"model": torch.nn.Linear(4, 2)})


REPEAT_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import ckpt
    import elastic

    root = sys.argv[1]
    elastic.init_distributed()
    model = torch.nn.Linear(8, 2)
    sampler = elastic.ElasticSampler(64, 8, seed=0)
    manager = ckpt.CheckpointManager(root, {"model": model, "sampler": sampler}, every=2)
    with manager, elastic.RunGuard(saver=manager, watchdog_s=0) as guard:
        print("started", flush=True)
        start = manager.resume() or 0
        for step in guard.steps(start, 6):
            model(torch.randn(8, 8)).sum().backward()
            manager.maybe_save(step)  # the loop forgot sampler.advance()
    """
)


def test_a_deterministic_error_repeated_at_the_same_point_ends_the_later_attempts_at_once(
    tmp_path,
):
    """Attempts of one torchrun job (its run id and restart count, as torchrun sets them):
    the forgotten ``advance()`` fails attempts 0 and 1 at step 2; attempt 2 ends at
    start-up, before any model, manager or resume; a new launch of the same run id
    starts normally."""
    script = tmp_path / "repeat.py"
    script.write_text(REPEAT_SCRIPT)
    root = str(tmp_path / "ckpt")

    def attempt(count: int) -> subprocess.CompletedProcess:
        return run(
            str(script),
            root,
            env_extra={
                "TORCHELASTIC_RUN_ID": "job-1",
                "TORCHELASTIC_RESTART_COUNT": str(count),
                "TMPDIR": str(tmp_path),
            },
        )

    first = attempt(0)
    assert first.returncode == 1 and "started" in first.stdout, first.stderr
    assert "DataPositionError at step 2 is an error a restart reproduces" in first.stderr
    second = attempt(1)
    assert second.returncode == 1 and "started" in second.stdout, second.stderr
    assert "DataPositionError at step 2 again, as in the attempt before" in second.stderr
    third = attempt(2)
    assert third.returncode == 1, third.stderr
    assert "started" not in third.stdout  # ended in init_distributed, before anything else
    assert "restart 2 of this job ends at start-up" in third.stderr
    assert "DataPositionError at step 2" in third.stderr and "Traceback" not in third.stderr

    relaunched = attempt(0)  # the same run id launched again: its own first attempt
    assert "started" in relaunched.stdout, relaunched.stderr
    assert "is an error a restart reproduces" in relaunched.stderr


BATCH_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import ckpt
    import elastic

    root, batch = sys.argv[1], int(sys.argv[2])
    model = torch.nn.Linear(4, 2)
    sampler = elastic.ElasticSampler(25, batch, seed=0, rank=0, world_size=2,
                                     allow_batch_change=True)
    loader = sampler.epoch_loader(range(25), collate_fn=list)
    with ckpt.CheckpointManager(root, {"model": model, "sampler": sampler}, every=1) as manager:
        step = manager.resume() or 0
        for batch_ids in loader:  # the rest of the cursor's epoch
            step += 1
            manager.maybe_save(step)
    """
)


def test_a_dropped_epoch_tail_and_a_global_batch_change_are_said(tmp_path):
    script = tmp_path / "batch.py"
    script.write_text(BATCH_SCRIPT)
    root = str(tmp_path / "ckpt")
    first = run(str(script), root, "8")  # 25 = 3 x 8 + 1: one sample cannot feed 2 ranks
    assert first.returncode == 0, first.stderr
    assert "epoch 0: its last 1 sample(s) are dropped: fewer than the 2 ranks" in first.stderr
    second = run(str(script), root, "10")  # the next epoch with a bigger global batch
    assert second.returncode == 0, second.stderr
    assert "the global batch changes from 8 to 10 at sample cursor 25" in second.stderr
    assert "allow_batch_change=True" in second.stderr
