"""End-to-end runs of ``python -m trainer`` on gloo: real processes, real checkpoints.

Multi-rank runs start one ``python -m trainer`` process per rank with the environment
torchrun would give them (RANK, WORLD_SIZE, MASTER_ADDR/PORT on a free port), without the
agent process, to keep CI fast on small machines. Single-rank error paths run the entry
point in-process. Everything is checked on outputs, not log wording: per-step losses and
sample digests (metrics.jsonl), resume events (events.jsonl) and the final full
parameters that ``run.save_final`` writes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from testing.ports import free_port
from trainer.__main__ import main as trainer_main
from trainer.corpus import arithmetic_tokens

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_TIMEOUT_S = 150

TINY = [
    "--config", "examples/tiny_gpt.toml",
    "--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "model.seq_len=32",
    "--set", "data.corpus_chars=20000", "--set", "data.global_batch=12", "--set", "data.micro_batch=1",
    "--set", "optim.warmup_steps=4", "--set", "optim.decay_steps=16",
    "--set", "run.save_final=true", "--set", "run.log_every=4",
]  # fmt: skip
"""12 samples per step: gradient accumulation 12, 6, 4, 3 on 1, 2, 3, 4 ranks."""

# Across world sizes the same micro-batches are computed (same samples, same dropout
# seeds), but gradients and losses are summed in another order (float32 addition is not
# associative), and Adam divides by sqrt(v), which can amplify last-bit differences of tiny
# gradient entries. Observed loss differences over 16 steps are ~2e-7; 1e-4 leaves room
# yet catches a wrong sample, a gradient off by a factor of the world size, or lost
# optimizer state (each moves the loss by >1e-3 within a few steps).
CROSS_WORLD_LOSS_ATOL = 1e-4
CROSS_WORLD_PARAM_ATOL = 1e-4


def run_trainer(nproc: int, args: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m trainer`` as ``nproc`` ranks; returns rank 0's process (stderr of all)."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("TRAINER_FAULTS", None)
        if nproc > 1:
            env.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            )  # fmt: skip
        cmd = [sys.executable, "-m", "trainer", *args]
        procs.append(
            subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs, codes = [], []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
            outputs.append(out)
            codes.append(proc.returncode)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    result = subprocess.CompletedProcess(args, codes[0], stdout="", stderr="\n".join(outputs))
    if check and any(codes):
        raise AssertionError(f"trainer failed (exit codes {codes}):\n{result.stderr[-6000:]}")
    return result


@pytest.fixture
def restore_torch_flags():
    """In-process runs: one intra-op thread (as torchrun gives each worker, and much faster
    on a busy 2-core CI machine); the deterministic-algorithms flag is put back afterwards."""
    deterministic, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.use_deterministic_algorithms(deterministic)
    torch.set_num_threads(threads)


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def metrics_by_step(run_dir: str) -> dict[int, dict]:
    return {m["step"]: m for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}


def final_params(run_dir: str) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(run_dir, "final_params.pt"), weights_only=True)


def resume_event(run_dir: str) -> dict:
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    resumes = [e for e in events if e["event"] == "resume"]
    assert len(resumes) == 1, resumes
    return resumes[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 2-rank run of 16 steps, and its step-8 checkpoint alone in a root.

    The baseline checkpoints at step 8 (saving reads the training state, never writes
    it); copying only checkpoint_0000008 gives the state of a run stopped after step 8.
    """
    root = tmp_path_factory.mktemp("trainer_e2e")
    base, base_ckpt = str(root / "base"), str(root / "base_ckpt")
    run_trainer(
        2,
        [
            *TINY,
            "--max-steps",
            "16",
            "--ckpt-every",
            "8",
            "--ckpt-dir",
            base_ckpt,
            "--run-dir",
            base,
        ],
    )
    half_ckpt = str(root / "half_ckpt")
    shutil.copytree(
        os.path.join(base_ckpt, "checkpoint_0000008"), os.path.join(half_ckpt, "checkpoint_0000008")
    )
    return {"root": root, "base": base, "half_ckpt": half_ckpt}


def copy_half(runs: dict, name: str) -> str:
    """A fresh checkpoint root holding only the baseline's step-8 checkpoint."""
    target = str(runs["root"] / name)
    shutil.copytree(runs["half_ckpt"], target)
    return target


def resume_half(runs: dict, name: str, nproc: int) -> str:
    """Resume the step-8 checkpoint on ``nproc`` ranks up to step 16; returns the run dir."""
    ckpt_dir, run_dir = copy_half(runs, f"{name}_ckpt"), str(runs["root"] / f"{name}_run")
    args = ["--max-steps", "16", "--ckpt-every", "0", "--ckpt-dir", ckpt_dir, "--run-dir", run_dir]
    run_trainer(nproc, [*TINY, *args])
    return run_dir


@pytest.mark.timeout(300)
def test_same_world_size_resume_is_bitwise_identical(runs):
    run_dir = resume_half(runs, "same", nproc=2)

    base, resumed = metrics_by_step(runs["base"]), metrics_by_step(run_dir)
    assert sorted(resumed) == list(range(9, 17))
    for step in range(9, 17):
        assert resumed[step]["loss"] == base[step]["loss"], step
        assert resumed[step]["grad_norm"] == base[step]["grad_norm"], step
        assert resumed[step]["samples_digest"] == base[step]["samples_digest"], step
    expected, got = final_params(runs["base"]), final_params(run_dir)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    event = resume_event(run_dir)
    assert (event["step"], event["old_world_size"], event["new_world_size"]) == (8, 2, 2)
    assert event["rng_restored"] is True


@pytest.mark.timeout(300)
def test_async_checkpoints_resume_bitwise_identically(runs):
    """Async saves stage step S's state and commit it while training goes on; resuming
    from such a checkpoint must continue exactly like the synchronous baseline."""
    root = runs["root"]
    async_ckpt, async_run = str(root / "async_ckpt"), str(root / "async_run")
    args = ["--max-steps", "16", "--ckpt-every", "4", "--set", "checkpoint.async_save=true"]
    run_trainer(2, [*TINY, *args, "--ckpt-dir", async_ckpt, "--run-dir", async_run])
    saved = [
        e
        for e in read_jsonl(os.path.join(async_run, "events.jsonl"))
        if e["event"] == "checkpoint_saved"
    ]
    assert [e["step"] for e in saved] == [4, 8, 12, 16]
    assert [e["async"] for e in saved] == [True, True, True, False]  # the last save is synchronous
    base = metrics_by_step(runs["base"])
    assert all(metrics_by_step(async_run)[s]["loss"] == base[s]["loss"] for s in range(1, 17))

    half = str(root / "async_half")
    shutil.copytree(
        os.path.join(async_ckpt, "checkpoint_0000008"), os.path.join(half, "checkpoint_0000008")
    )
    run_dir = str(root / "async_resumed")
    run_trainer(
        2,
        [*TINY, "--max-steps", "16", "--ckpt-every", "0", "--ckpt-dir", half, "--run-dir", run_dir],
    )
    resumed = metrics_by_step(run_dir)
    for step in range(9, 17):
        assert resumed[step]["loss"] == base[step]["loss"], step
    expected, got = final_params(runs["base"]), final_params(run_dir)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def assert_matches_baseline(base_dir: str, run_dir: str, steps: range) -> None:
    base, run = metrics_by_step(base_dir), metrics_by_step(run_dir)
    for step in steps:
        assert run[step]["samples_digest"] == base[step]["samples_digest"], step
        assert abs(run[step]["loss"] - base[step]["loss"]) <= CROSS_WORLD_LOSS_ATOL, step
    expected, got = final_params(base_dir), final_params(run_dir)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=CROSS_WORLD_PARAM_ATOL)


@pytest.mark.timeout(300)
def test_resume_on_three_ranks_continues_the_same_samples(runs):
    run_dir = resume_half(runs, "three", nproc=3)
    metrics = metrics_by_step(run_dir)
    assert sorted(metrics) == list(range(9, 17))
    assert {m["world_size"] for m in metrics.values()} == {3}
    assert_matches_baseline(runs["base"], run_dir, range(9, 17))
    event = resume_event(run_dir)
    assert (event["step"], event["old_world_size"], event["new_world_size"]) == (8, 2, 3)
    assert event["data_cursor"] == 8 * 12
    assert event["rng_restored"] is False


@pytest.mark.timeout(300)
def test_four_ranks_then_two(runs):
    ckpt_dir, run_dir = str(runs["root"] / "four_ckpt"), str(runs["root"] / "four_run")
    run_trainer(
        4,
        [
            *TINY,
            "--max-steps",
            "8",
            "--ckpt-every",
            "8",
            "--ckpt-dir",
            ckpt_dir,
            "--run-dir",
            run_dir,
        ],
    )
    run_trainer(
        2,
        [
            *TINY,
            "--max-steps",
            "16",
            "--ckpt-every",
            "0",
            "--ckpt-dir",
            ckpt_dir,
            "--run-dir",
            run_dir,
        ],
    )
    world = {step: m["world_size"] for step, m in metrics_by_step(run_dir).items()}
    assert world == {s: 4 if s <= 8 else 2 for s in range(1, 17)}
    assert_matches_baseline(runs["base"], run_dir, range(1, 17))
    event = resume_event(run_dir)
    assert (event["old_world_size"], event["new_world_size"]) == (4, 2)


@pytest.mark.timeout(200)
def test_loss_falls_on_builtin_corpus(tmp_path, restore_torch_flags):
    """The model beats the corpus's unigram entropy: it learned context, not just frequencies."""
    run_dir = str(tmp_path / "run")
    args = [*TINY, "--max-steps", "30", "--run-dir", run_dir, "--set", "optim.lr=2e-2",
            "--set", "optim.warmup_steps=5", "--set", "optim.decay_steps=30"]  # fmt: skip
    assert trainer_main(args) == 0
    losses = [metrics_by_step(run_dir)[s]["loss"] for s in range(1, 31)]
    tokens, _ = arithmetic_tokens(1234, 20000)
    freq = np.bincount(tokens) / len(tokens)
    freq = freq[freq > 0]
    unigram_entropy = float(-(freq * np.log(freq)).sum())  # ~2.65 nats; uniform is ln(15) ~ 2.71
    final = float(np.mean(losses[-5:]))
    assert final < losses[0] - 0.2, (losses[0], final)
    assert final < unigram_entropy - 0.1, (unigram_entropy, final)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--set", "model.n_layers=3"], "unknown key model.n_layers"),
        (["--set", "optim.lr=-1"], "optim.lr=-1.0"),
        (["--set", "run.max_steps=lots"], "run.max_steps='lots'"),
    ],
)
def test_config_errors_exit_before_training(tmp_path, capsys, extra, message):
    """The real entry point, in-process: argparse-style exit 2 before any process group."""
    with pytest.raises(SystemExit) as info:
        trainer_main([*TINY, "--run-dir", str(tmp_path), *extra])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "metrics.jsonl")


@pytest.mark.timeout(60)
def test_indivisible_global_batch_fails_before_rendezvous(tmp_path, monkeypatch, caplog):
    """Each rank knows WORLD_SIZE from torchrun's environment, so no collective is needed."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    args = [
        *TINY,
        "--set",
        "data.global_batch=6",
        "--set",
        "data.micro_batch=2",
        "--run-dir",
        str(tmp_path),
    ]
    with caplog.at_level(logging.ERROR):
        assert trainer_main(args) == 1
    assert (
        "data.global_batch=6 is not divisible by world_size*data.micro_batch = 2*2 = 4"
        in caplog.text
    )


@pytest.mark.timeout(60)
def test_unreachable_checkpoint_dir(tmp_path, caplog, restore_torch_flags):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    bad = str(blocker / "ckpt")
    with caplog.at_level(logging.ERROR):
        assert trainer_main([*TINY, "--max-steps", "1", "--ckpt-dir", bad]) == 1
    assert "CheckpointDirError" in caplog.text and repr(bad) in caplog.text


@pytest.mark.timeout(120)
def test_checkpoint_of_another_model_shape_names_the_tensor(runs, caplog, restore_torch_flags):
    ckpt_dir = copy_half(runs, "shape_ckpt")
    args = [*TINY, "--max-steps", "9", "--ckpt-dir", ckpt_dir, "--set", "model.d_model=48"]
    with caplog.at_level(logging.ERROR):
        assert trainer_main(args) == 1
    assert "CheckpointShapeError" in caplog.text
    expected = "'tok_emb.weight' has shape [15, 32] in the checkpoint but [15, 48] in this model"
    assert expected in caplog.text
    assert sorted(os.listdir(ckpt_dir)) == ["checkpoint_0000008"]  # nothing was written


@pytest.mark.timeout(120)
def test_sigterm_fault_stops_at_step_boundary_then_resumes(tmp_path, restore_torch_flags):
    """--fault fires at the start of step S: steps 1..S-1 are done, exit 143, resume goes on."""
    ckpt_dir, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
    args = [*TINY, "--ckpt-dir", ckpt_dir, "--run-dir", run_dir, "--ckpt-every", "1"]
    proc = run_trainer(1, [*args, "--max-steps", "5", "--fault", "sigterm:step=3"], check=False)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    assert sorted(metrics_by_step(run_dir)) == [1, 2]
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    assert [e["spec"] for e in events if e["event"] == "fault"] == ["sigterm:step=3:attempt=0"]
    assert [e["step"] for e in events if e["event"] == "preempted"] == [2]
    assert trainer_main([*args, "--max-steps", "4"]) == 0  # in-process: no interpreter start
    assert sorted(metrics_by_step(run_dir)) == [1, 2, 3, 4]
    assert resume_event(run_dir)["step"] == 2


@pytest.mark.timeout(200)
def test_ckpt_storage_fault_fails_one_save_cleanly_and_training_goes_on(tmp_path):
    """--fault ckpt-storage on rank 1: the collective save of step 4 fails on every rank,
    nothing is committed for it, training continues and the next save commits."""
    ckpt_dir, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
    run_trainer(
        2,
        [*TINY, "--max-steps", "6", "--ckpt-every", "2", "--fault", "ckpt-storage:step=4:rank=1",
         "--ckpt-dir", ckpt_dir, "--run-dir", run_dir],
    )  # fmt: skip
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    assert [e["step"] for e in events if e["event"] == "checkpoint_saved"] == [2, 6]
    failed = [e for e in events if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [4] and "rank 1" in failed[0]["error"]
    assert sorted(metrics_by_step(run_dir)) == list(range(1, 7))
    import ckpt

    infos = {i.step: i.committed for i in ckpt.list_checkpoints(ckpt_dir)}
    assert infos.get(2) and infos.get(6) and not infos.get(4, False)
    # The fault fired on rank 1 is recorded by rank 1 and counted by the report.
    rank1 = read_jsonl(os.path.join(run_dir, "events.rank1.jsonl"))
    assert [(e["event"], e["step"], e["rank"]) for e in rank1] == [("fault", 4, 1)]
    from trainer.report import load_run_dir, summarize, timeline_marks

    metrics, events = load_run_dir(run_dir)
    summary = summarize(metrics, events)
    assert summary.faults_injected == 1 and summary.fault_ranks == [1]
    fault_marks = [
        m for kind, ms in timeline_marks(events, 0.0).items() for m in ms if kind == "fault"
    ]
    assert [(step, rank) for _, step, rank in fault_marks] == [(4, 1)]


@pytest.mark.timeout(120)
def test_a_new_launch_that_resumes_at_its_max_steps_says_so_and_exits_1(
    tmp_path, caplog, restore_torch_flags
):
    ckpt_dir = str(tmp_path / "ckpt")
    where = [*TINY, "--ckpt-every", "2", "--ckpt-dir", ckpt_dir, "--run-dir", str(tmp_path / "r")]
    args = [*where, "--max-steps", "4"]
    assert trainer_main(args) == 0
    with caplog.at_level(logging.ERROR):
        assert trainer_main(args) == 1  # another job's checkpoint, or this run already done
    assert "ResumePastEndError" in caplog.text and "nothing to train" in caplog.text
    assert "run.max_steps=4" in caplog.text
    assert trainer_main([*args, "--set", "run.allow_resume_past_end=true"]) == 0
    assert trainer_main([*where, "--max-steps", "6"]) == 0  # train further


@pytest.mark.timeout(120)
def test_a_resume_of_a_checkpoint_written_with_other_settings_says_which(
    tmp_path, caplog, restore_torch_flags
):
    where = [*TINY, "--ckpt-every", "2", "--ckpt-dir", str(tmp_path / "ckpt"),
             "--run-dir", str(tmp_path / "r")]  # fmt: skip
    assert trainer_main([*where, "--max-steps", "2"]) == 0
    with caplog.at_level(logging.WARNING, logger="trainer"):
        assert trainer_main([*where, "--max-steps", "4", "--set", "optim.lr=1e-3"]) == 0
    said = [r.getMessage() for r in caplog.records if "other optim settings" in r.getMessage()]
    assert said and "data" not in said[0].split("settings")[0], said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer"):
        assert trainer_main([*where, "--max-steps", "6", "--set", "optim.lr=1e-3"]) == 0
    assert not any("other" in r.getMessage() and "settings" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(120)
def test_checkpoint_every_s_saves_by_the_clock(tmp_path, restore_torch_flags):
    ckpt_dir = str(tmp_path / "ckpt")
    args = [*TINY, "--max-steps", "5", "--ckpt-dir", ckpt_dir, "--run-dir", str(tmp_path / "r"),
            "--ckpt-every", "0", "--set", "checkpoint.every_s=0.001",
            "--set", "checkpoint.keep_last=0"]  # fmt: skip
    assert trainer_main(args) == 0
    import ckpt

    assert [i.step for i in ckpt.list_checkpoints(ckpt_dir)] == [5, 4, 3, 2, 1]
