"""End-to-end: train on 2 ranks under torchrun, export, load the export elsewhere.

- A tiny transformers Llama (tests/e2e/scripts/train_tiny_llama.py: FSDP2 on gloo, public
  ckpt API only) is exported with ``python -m ckpt export`` to safetensors and with
  ``ckpt.export`` to torch: both equal the trained model's full state tensor by tensor,
  and ``AutoModelForCausalLM.from_pretrained(OUT)`` reproduces the logits the script
  computed from that full state.
- Our built-in GPT (``python -m trainer`` on 2 ranks) exported to safetensors and read
  back with ``safetensors.torch.load_file`` equals the trainer's final parameters.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_trainer_e2e import TINY

import ckpt
from testing.local_cluster import REPO
from testing.procs import torchrun_trainer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCRIPT = os.path.join(REPO, "tests", "e2e", "scripts", "train_tiny_llama.py")
STEPS = 3
RUN_TIMEOUT_S = 150
GPT_ARGS = [*TINY, "--max-steps", "3", "--ckpt-every", "3"]


def cli_export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckpt", "export", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """The 2-rank Llama run: its checkpoint root and the script's reference outputs."""
    base = tmp_path_factory.mktemp("llama")
    ckpt_dir, ref = str(base / "ckpt"), str(base / "ref")
    result = torchrun_trainer(
        ["--ckpt-dir", ckpt_dir, "--out-dir", ref, "--steps", str(STEPS)],
        cwd=REPO,
        nproc=2,
        timeout_s=RUN_TIMEOUT_S,
        program=(SCRIPT,),
    )
    assert result.returncode == 0, result.stdout[-6000:]
    return base, ckpt_dir, ref


def test_llama_safetensors_export_loads_in_transformers_with_the_same_logits(llama_run):
    from transformers import AutoModelForCausalLM

    base, ckpt_dir, ref = llama_run
    out = str(base / "hf")
    done = cli_export(ckpt_dir, out, "--config", os.path.join(ref, "config.json"))
    assert done.returncode == 0, done.stderr
    assert f"exported step {STEPS}" in done.stdout
    full = torch.load(os.path.join(ref, "full_state.pt"), weights_only=True)
    assert_same_tensors(load_file(os.path.join(out, "model.safetensors")), full)

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    expected = torch.load(os.path.join(ref, "logits.pt"), weights_only=True)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"]).logits
    # Same weights, same ops; only the thread count may differ from the script's process.
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-5)


def test_llama_torch_export_and_bf16_shards_equal_the_full_state(llama_run):
    base, ckpt_dir, ref = llama_run
    full = torch.load(os.path.join(ref, "full_state.pt"), weights_only=True)
    out = str(base / "model.pt")
    ckpt.export(ckpt_dir, out, format="torch")
    assert_same_tensors(torch.load(out, weights_only=True), full)

    sharded = str(base / "hf_bf16")
    result = ckpt.export(ckpt_dir, sharded, dtype="bf16", max_shard_size="64KB")
    shards = [f for f in result.files if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in result.files
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        merged.update(load_file(os.path.join(sharded, shard)))
    assert_same_tensors(merged, {k: v.to(torch.bfloat16) for k, v in full.items()})


def test_builtin_gpt_checkpoint_exports_to_safetensors(tmp_path):
    ckpt_dir, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
    result = torchrun_trainer(
        [*GPT_ARGS, "--ckpt-dir", ckpt_dir, "--run-dir", run_dir],
        cwd=REPO,
        nproc=2,
        timeout_s=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-6000:]
    out = str(tmp_path / "gpt")
    done = cli_export(ckpt_dir, out, "--step", "3")
    assert done.returncode == 0, done.stderr
    final = torch.load(os.path.join(run_dir, "final_params.pt"), weights_only=True)
    assert_same_tensors(load_file(os.path.join(out, "model.safetensors")), final)
