"""The CUDA path: FSDP2 on a GPU with NCCL, saves (sync, async from device memory, memory
tier), a kill and a bitwise resume, then the GPU's checkpoint resharded onto CPU ranks.

Runs only where CUDA is available (CI has no GPU; the skip says so). One GPU is enough:
NCCL refuses two ranks on one device, so the GPU runs have one rank and the reshard runs
two gloo ranks on the CPU (``CUDA_VISIBLE_DEVICES=""``), reading the GPU's checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from testing.procs import TORCHRUN_CLEAN_ENV, run_bounded

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none: run on a GPU host)"
    ),
]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = [
    "--config", "examples/tiny_gpt.toml",
    "--set", "model.d_model=64", "--set", "model.n_head=4", "--set", "model.seq_len=32",
    "--set", "data.corpus_chars=20000", "--set", "data.global_batch=8",
    "--set", "data.micro_batch=2", "--set", "run.log_every=1", "--set", "run.watchdog_s=60",
]  # fmt: skip


def _torchrun(args: list[str], *, nproc: int, cpu: bool = False, restarts: int = 0):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_CLEAN_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", f"--max_restarts={restarts}", "--monitor_interval=0.5",
        "-m", "trainer", *TINY, *args,
    ]  # fmt: skip
    return run_bounded(cmd, env=env, cwd=REPO, timeout_s=240)


def _losses(run_dir: str) -> dict[int, float]:
    out: dict[int, float] = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "loss" in row and "step" in row:
                out[row["step"]] = row["loss"]  # the last row of a step wins (after a resume)
    return out


def _events(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_fsdp2_on_cuda_resumes_bitwise_after_a_kill_and_reshards_onto_cpu_ranks(tmp_path):
    ref_ckpt, ref_run = str(tmp_path / "ref-ckpt"), str(tmp_path / "ref-run")
    ref = _torchrun(
        ["--max-steps", "12", "--ckpt-every", "4", "--ckpt-dir", ref_ckpt, "--run-dir", ref_run],
        nproc=1,
    )
    assert ref.returncode == 0, ref.stdout[-4000:]
    assert "backend=nccl" in ref.stdout and "device=cuda:0" in ref.stdout, ref.stdout[-2000:]

    # async saves staged from device memory, memory snapshots every 2 steps, a kill at 10
    ckpt_dir, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
    killed = _torchrun(
        [
            "--max-steps", "12", "--ckpt-every", "4", "--ckpt-dir", ckpt_dir,
            "--run-dir", run_dir, "--fault", "kill:step=10:attempt=0",
            "--set", "checkpoint.async_save=true", "--set", "checkpoint.memory_every=2",
        ],
        nproc=1,
        restarts=1,
    )  # fmt: skip
    assert killed.returncode == 0, killed.stdout[-4000:]
    resumes = [e for e in _events(run_dir) if e.get("event") == "resume"]
    assert resumes, "the killed run did not resume"
    assert len(_losses(ref_run)) == 12
    assert _losses(run_dir) == _losses(ref_run)  # bitwise: every step's loss

    # the GPU's checkpoint of step 12, continued on 2 CPU ranks (resharded 1 -> 2)
    gpu_ckpt = str(tmp_path / "gpu-ckpt")
    shutil.copytree(ref_ckpt, gpu_ckpt)
    cpu_run = str(tmp_path / "cpu-run")
    cont = _torchrun(
        ["--max-steps", "16", "--ckpt-every", "4", "--ckpt-dir", ref_ckpt, "--run-dir", cpu_run],
        nproc=2,
        cpu=True,
    )
    assert cont.returncode == 0, cont.stdout[-4000:]
    assert "backend=gloo" in cont.stdout
    cpu_resume = [e for e in _events(cpu_run) if e.get("event") == "resume"]
    assert cpu_resume and cpu_resume[0].get("step") == 12
    # ... and on the GPU, for comparison: same samples; the loss differs only by float order
    gpu_run = str(tmp_path / "gpu-run")
    cont_gpu = _torchrun(
        ["--max-steps", "16", "--ckpt-every", "4", "--ckpt-dir", gpu_ckpt, "--run-dir", gpu_run],
        nproc=1,
    )
    assert cont_gpu.returncode == 0, cont_gpu.stdout[-4000:]
    cpu_losses, gpu_losses = _losses(cpu_run), _losses(gpu_run)
    for step in range(13, 17):
        assert abs(cpu_losses[step] - gpu_losses[step]) < 1e-3, (step, cpu_losses, gpu_losses)
