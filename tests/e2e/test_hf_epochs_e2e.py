"""End-to-end: examples/hf_llama_epochs.py, an epoch loop as Hugging Face users write it.

A tiny ``LlamaForCausalLM`` (tied embeddings, started from a ``save_pretrained``
directory), a padding collate, ``DataLoader(num_workers=1)``, a cosine schedule and FSDP2
per layer, for 3 epochs of 28 sequences in global batches of 8 (4 steps per epoch, the
last one 4 sequences): real ``torchrun`` processes, each bounded, checked on the run's
outputs (metrics.jsonl rows with the epoch and the sample ids of every step,
events.jsonl, the checkpoints and the export).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from test_bring_your_own_model import read_jsonl

from testing.local_cluster import REPO
from testing.procs import TORCHRUN_CLEAN_ENV, RunTimeoutError, run_bounded, torchrun_trainer

pytestmark = pytest.mark.e2e

SCRIPT = os.path.join(REPO, "examples", "hf_llama_epochs.py")
TIMEOUT_S = 150
SAMPLES, EPOCHS, STEPS = 28, 3, 12
# A resume on another world size computes the same sequences and divides by the same token
# count; only the order of float32 sums differs (observed <= 2.4e-7 over 12 steps). A wrong
# batch or a lost optimizer or scheduler state moves the loss by far more than 1e-4.
CROSS_WORLD_LOSS_ATOL = 1e-4


def _example():
    spec = importlib.util.spec_from_file_location("hf_llama_epochs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch(
    nproc: int, ckpt_dir: str, run_dir: str, *args: str, max_restarts: int = 0, ok: bool = True
) -> subprocess.CompletedProcess:
    """The example on ``nproc`` ranks under torchrun (``nproc=0``: one plain process); with
    ``ok``, it must exit 0."""
    flags = ["--ckpt-dir", ckpt_dir, "--run-dir", run_dir, *args]
    try:
        if nproc:
            result = torchrun_trainer(
                flags,
                cwd=REPO,
                nproc=nproc,
                max_restarts=max_restarts,
                timeout_s=TIMEOUT_S,
                program=(SCRIPT,),
            )
        else:
            env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_CLEAN_ENV}
            env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            cmd = [sys.executable, SCRIPT, *flags]
            result = run_bounded(cmd, env=env, cwd=REPO, timeout_s=TIMEOUT_S)
    except RunTimeoutError as exc:
        pytest.fail(str(exc))
    assert not ok or result.returncode == 0, result.stdout[-6000:]
    return result


def rows(run_dir: str) -> dict[int, dict]:
    """metrics.jsonl by step; a step run again after a restart keeps its last row."""
    return {r["step"]: r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}


def events(run_dir: str, name: str) -> list[dict]:
    return [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e["event"] == name]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_epochs")


@pytest.fixture(scope="module")
def init_dir(root) -> str:
    """A tiny random Llama as transformers saves it: the runs start from it."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(7)
    model = LlamaForCausalLM(_example().model_config())
    path = str(root / "init")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def base(root, init_dir) -> dict:
    """The uninterrupted 2-rank run: 3 epochs, a checkpoint every 2 steps."""
    ckpt_dir, run_dir = str(root / "base_ckpt"), str(root / "base_run")
    started = launch(2, ckpt_dir, run_dir, "--init-from", init_dir)
    assert f"model initialized from {init_dir}" in started.stdout  # ckpt.load_pretrained
    got = rows(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s]["epoch"] for s in got] == [0] * 4 + [1] * 4 + [2] * 4
    for epoch in range(EPOCHS):  # every sequence once per epoch
        ids = [i for s in got if got[s]["epoch"] == epoch for i in got[s]["samples"]]
        assert sorted(ids) == list(range(SAMPLES)), epoch
    assert got[STEPS]["loss"] < got[1]["loss"]
    return {"ckpt_dir": ckpt_dir, "run_dir": run_dir, "rows": got}


@pytest.mark.timeout(300)
def test_a_kill_in_epoch_two_resumes_bitwise_at_its_epoch_and_batch(root, init_dir, base):
    ckpt_dir, run_dir = str(root / "kill_ckpt"), str(root / "kill_run")
    args = ["--init-from", init_dir, "--fault", "kill:step=7:rank=1"]
    result = launch(2, ckpt_dir, run_dir, *args, max_restarts=1)
    assert result.stdout.count("model initialized from") == 1  # the restart resumed instead
    got = rows(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))  # ended after 3 epochs, not one step more
    for step in got:
        for key in ("loss", "epoch", "samples", "lr"):
            assert got[step][key] == base["rows"][step][key], (step, key)
    assert [got[s]["restart_count"] for s in range(7, STEPS + 1)] == [1] * 6
    assert [(e["step"], e["new_world_size"]) for e in events(run_dir, "resume")] == [(6, 2)]
    assert got[7]["epoch"] == 1  # step 7 is the 3rd batch of the 2nd epoch
    final = torch.load(os.path.join(run_dir, "final_logits.pt"))
    want = torch.load(os.path.join(base["run_dir"], "final_logits.pt"))
    assert torch.equal(final["logits"], want["logits"])


@pytest.mark.timeout(300)
def test_two_ranks_then_one_continues_the_same_samples_to_the_last_epoch(root, init_dir, base):
    ckpt_dir, run_dir = str(root / "shrink_ckpt"), str(root / "shrink_run")
    stopped = launch(
        2, ckpt_dir, run_dir, "--init-from", init_dir, "--fault", "exit:step=7", ok=False
    )
    assert stopped.returncode != 0
    launch(0, ckpt_dir, run_dir, "--init-from", init_dir)  # one plain process
    got = rows(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert got[step]["samples"] == base["rows"][step]["samples"], step
        assert got[step]["epoch"] == base["rows"][step]["epoch"], step
        assert abs(got[step]["loss"] - base["rows"][step]["loss"]) <= CROSS_WORLD_LOSS_ATOL, step
        assert got[step]["world_size"] == (2 if step <= 6 else 1), step
    assert [(e["step"], e["old_world_size"], e["new_world_size"])
            for e in events(run_dir, "resume")] == [(6, 2, 1)]  # fmt: skip
    assert [e["step"] for e in events(run_dir, "finished")] == [STEPS]


@pytest.mark.timeout(300)
def test_the_export_loads_with_from_pretrained_with_equal_logits_and_one_tied_weight(root, base):
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import LlamaForCausalLM

    newest = os.path.join(base["ckpt_dir"], f"checkpoint_{STEPS:07d}")
    stored = FileSystemReader(newest).read_metadata().state_dict_metadata
    assert "model.model.embed_tokens.weight" in stored
    assert "model.lm_head.weight" not in stored  # the tied weight is stored once

    out = str(root / "export")
    cmd = [sys.executable, "-m", "ckpt", "export", base["ckpt_dir"], out]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names

    model = LlamaForCausalLM.from_pretrained(out).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again on load
    final = torch.load(os.path.join(base["run_dir"], "final_logits.pt"))
    with torch.no_grad():
        logits = model(input_ids=final["input_ids"]).logits
    assert torch.equal(logits, final["logits"])  # the trained model, bit for bit


@pytest.mark.timeout(300)
def test_two_to_four_ranks_with_the_global_batch_doubled_continues_at_the_same_sample(
    root, init_dir
):
    ckpt_dir, run_dir = str(root / "grow_ckpt"), str(root / "grow_run")
    stopped = launch(
        2, ckpt_dir, run_dir, "--init-from", init_dir, "--fault", "exit:step=7", ok=False
    )
    assert stopped.returncode != 0  # steps 1-6 done, checkpoint 6: epoch 1, at sample 16 of 28
    args = ["--init-from", init_dir, "--global-batch", "16", "--allow-batch-change"]
    grown = launch(4, ckpt_dir, run_dir, *args)
    assert "the global batch changes from 8 to 16 at sample cursor 44" in grown.stdout
    changes = events(run_dir, "batch_change")
    assert [(e["step"], e["cursor"], e["old_global_batch"], e["new_global_batch"])
            for e in changes] == [(6, 44, 8, 16)]  # fmt: skip
    got = rows(run_dir)
    steps = sorted(got)
    assert steps == list(range(1, len(steps) + 1))
    assert [got[s]["world_size"] for s in steps] == [2] * 6 + [4] * 3
    assert [len(got[s]["samples"]) for s in steps[6:]] == [12, 16, 12]  # epoch ends kept
    for epoch in range(EPOCHS):  # over the whole run: no sample twice, none missing
        ids = [i for s in steps if got[s]["epoch"] == epoch for i in got[s]["samples"]]
        assert sorted(ids) == list(range(SAMPLES)), epoch
