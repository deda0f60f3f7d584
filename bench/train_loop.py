"""``trainer_overhead``: the trainer (checkpointing off) vs a plain FSDP2 loop, same model/data.

Both sides are 2 ranks on the tiny GPT of ``examples/tiny_gpt.toml``. The trainer
runs under ``torchrun --standalone`` (its real entry point) and its speed comes from
``metrics.jsonl``; the plain loop (:func:`bench.gpt.plain_step`) runs on ranks
spawned by :mod:`bench.spawn`. Steady-state steps/s on both sides: the first
``warmup`` steps are excluded, and the rate is the number of later steps over the
wall time between the end of the warm-up and the end of the last step (so the
trainer's per-step extras - metrics rows, loss all-reduce, sample-id gather - count).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

from bench.gpt import CONFIG, REPO
from bench.harness.local_cluster import read_jsonl
from runcore import events as ev


def plain_loop(rank: int, world: int, steps: int, warmup: int) -> dict[str, Any]:
    """``steps`` plain optimizer steps; rank 0's step end times (barrier after each step)."""
    import torch
    import torch.distributed as dist

    from bench.gpt import build_tiny_gpt, plain_step

    # As the trainer's workers run: torchrun sets OMP_NUM_THREADS=1, the config is
    # deterministic.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    g = build_tiny_gpt(rank, world)
    ends: list[float] = []
    cursor = 0
    for _ in range(steps):
        plain_step(g, cursor)
        cursor += g.layout.global_batch
        dist.barrier()
        ends.append(time.time())
    return {"ends": ends, "warmup": warmup}


def trainer_run(work: str, steps: int, timeout_s: float) -> tuple[list[float], int, str]:
    """Run the trainer (2 ranks, no checkpoint dir) for ``steps``.

    Returns its rows' ``time``, torchrun's exit code and, when non-zero, the lines of
    stderr that say why. A run that wrote every row and its ``finished`` event counts
    even if a worker then died on the way out (a SIGABRT at exit after training
    finished, see :func:`elastic.process.exit_now`); the exit code is reported in the
    metric's detail.
    """
    run_dir = os.path.join(work, f"trainer_{time.monotonic_ns()}")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "trainer", "--config", CONFIG, "--max-steps", str(steps), "--run-dir", run_dir,
        "--set", f"run.log_every={steps}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    out = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    finished = any(e.get("event") == ev.FINISHED for e in events)
    if len(rows) != steps or not finished:
        raise RuntimeError(f"trainer run failed (rc={out.returncode}): {out.stderr[-1500:]}")
    why = ""
    if out.returncode != 0:
        keys = ("terminate", "abort", "Abort", "Error", "error:", "exitcode")
        why = " | ".join(ln.strip() for ln in out.stderr.splitlines() if any(k in ln for k in keys))
    return [float(r["time"]) for r in rows], out.returncode, why[:600]


def steady_rate(ends: list[float], warmup: int) -> float:
    """Steps per second after the first ``warmup`` steps, from step end times."""
    if len(ends) <= warmup + 1:
        return float("nan")
    return (len(ends) - 1 - warmup) / (ends[-1] - ends[warmup])
