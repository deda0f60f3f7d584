"""The training loop: build the pieces, resume, train step by step, checkpoint, record.

Reads top to bottom like nanoGPT's train.py; construction lives in builders
(``build_samples``, ``build_model``, ``build_optimizer``), saving and resuming in
``trainer.checkpointing.Checkpointer``, and the elastic hooks (fault injection, SIGTERM,
watchdog, stragglers) in ``elastic``. Every rank runs ``train`` with the same config.

Step numbering: step ``S`` is the S-th optimizer step (1-based). Faults for step ``S`` and
preemption checks run at the start of step ``S``, before any compute, so "kill at step 5"
leaves steps 1..4 completed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from elastic.faults import FaultPlan, FaultSpec
from elastic.identity import RunIdentity, job_restart_count
from elastic.preemption import PreemptionHandler, agree_on_preemption
from elastic.straggler import StragglerMonitor
from elastic.watchdog import Watchdog
from trainer.build import build_model, build_optimizer
from trainer.checkpointing import Checkpointer, ResumeInfo, TrainProgress, check_checkpoint_dir
from trainer.config import TrainConfig
from trainer.data import (
    BatchLayout,
    GlobalOrder,
    TokenSamples,
    build_samples,
    micro_batch_ids,
    samples_digest,
)
from trainer.distributed import DistContext
from trainer.metrics import RunRecorder
from trainer.rng import seed_micro_batch
from trainer.schedule import lr_at

logger = logging.getLogger(__name__)

FINAL_PARAMS_FILE = "final_params.pt"
ENV_CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
"""Set (if unset) before CUDA work when ``run.deterministic``; a user's value wins."""
SLOW_PHASE_ALLOWANCE_S = 900.0
"""Watchdog allowance around checkpoint loads and saves (storage calls have own timeouts)."""


class TrainingPreempted(RuntimeError):
    """A termination signal stopped training at a step boundary (after any emergency save)."""

    def __init__(self, step: int, signal_name: str, saved: bool) -> None:
        super().__init__(
            f"stopped by {signal_name} after step {step}"
            + (" (emergency checkpoint saved)" if saved else " (resume from the last checkpoint)")
        )
        self.step = step
        self.exit_code = 128 + int(getattr(signal, signal_name, signal.SIGTERM))


@dataclass(frozen=True, slots=True)
class StepResult:
    """Outcome of one optimizer step, identical on every rank."""

    loss: float
    grad_norm: float
    sample_ids: np.ndarray


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: TokenSamples,
    order: GlobalOrder,
    layout: BatchLayout,
    progress: TrainProgress,
    cfg: TrainConfig,
    ctx: DistContext,
) -> StepResult:
    """One optimizer step over the global batch at ``progress.cursor`` (collective).

    The loss is the sum of per-sample losses divided by the global batch; gradients are
    SUM-reduced across ranks, so the update is the same at every world size.
    """
    step = progress.step + 1
    model.train()
    local_ids = micro_batch_ids(order, progress.cursor, layout, ctx.rank)
    loss_sum = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for k, ids in enumerate(local_ids):
        inputs, targets = samples.get(ids)
        inputs, targets = inputs.to(ctx.device), targets.to(ctx.device)
        seed_micro_batch(cfg.run.seed, step, ctx.rank * layout.accum + k)
        model.set_requires_gradient_sync(k == layout.accum - 1)  # reduce once, after the last
        per_sample = model(inputs, targets)
        (per_sample.sum() / layout.global_batch).backward()
        loss_sum += per_sample.detach().sum()
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss_sum)
    mine = torch.from_numpy(np.concatenate(local_ids)).to(ctx.device)
    gathered = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, mine)
    sample_ids = torch.cat(gathered).cpu().numpy()
    return StepResult(float(loss_sum) / layout.global_batch, float(grad_norm), sample_ids)


def save_final_params(model: torch.nn.Module, run_dir: str, ctx: DistContext) -> str | None:
    """Gather full parameters (collective) and write them on rank 0 for exact comparison."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    if not ctx.is_main or not run_dir:
        return None
    path = f"{run_dir}/{FINAL_PARAMS_FILE}"
    torch.save({name: t.detach().clone() for name, t in full.items()}, path)
    return path


def train(cfg: TrainConfig, ctx: DistContext) -> TrainProgress:
    """Train to ``run.max_steps``, resuming from ``checkpoint.dir`` when possible (all ranks).

    Raises ``TrainingPreempted`` after a SIGTERM (the entry point turns it into an exit code).
    """
    attempt = job_restart_count(RunIdentity.from_env())
    with contextlib.ExitStack() as stack:
        recorder = RunRecorder(cfg.run.run_dir, enabled=ctx.is_main)
        stack.callback(recorder.close)
        preemption = stack.enter_context(PreemptionHandler())
        return _train(cfg, ctx, attempt, recorder, preemption, stack)
    raise AssertionError("unreachable")  # pragma: no cover


def _build_checkpointer(
    cfg: TrainConfig, ctx: DistContext, attempt: int, recorder: RunRecorder
) -> Checkpointer | None:
    if not cfg.checkpoint.dir:
        return None
    extra = {
        "seed": cfg.run.seed,
        "data_seed": cfg.data.seed,
        "global_batch": cfg.data.global_batch,
        "model_digest": cfg.model_digest(),
        "restart_count": attempt,
    }
    return Checkpointer(
        cfg.checkpoint.dir,
        ctx,
        seed=cfg.run.seed,
        extra_metadata=extra,
        record_event=recorder.event,
        async_save=cfg.checkpoint.async_save,
    )


def _report_resume(
    resumed: ResumeInfo | None,
    progress: TrainProgress,
    attempt: int,
    recorder: RunRecorder,
    ctx: DistContext,
) -> None:
    if resumed is None:
        if ctx.is_main:
            logger.info("rank 0: no committed checkpoint found; starting from step 0")
        return
    rng_note = "restored per rank" if resumed.rng_restored else "re-derived from (seed, step, rank)"
    if ctx.is_main:
        logger.info(
            "rank 0: resumed step %d from %s (world size %d -> %d, data cursor %d, RNG %s, %.2fs)",
            resumed.step, resumed.url, resumed.old_world_size, resumed.new_world_size,
            progress.cursor, rng_note, resumed.duration_s,
        )  # fmt: skip
    recorder.event(
        "resume", resumed.step, url=resumed.url, old_world_size=resumed.old_world_size,
        new_world_size=resumed.new_world_size, data_cursor=progress.cursor,
        rng_restored=resumed.rng_restored, restart_count=attempt,
        bytes=resumed.bytes_read, duration_s=resumed.duration_s,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class TrainingRun:
    """Everything built for one attempt: the same on every rank except the shards."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    samples: TokenSamples
    order: GlobalOrder
    layout: BatchLayout
    faults: FaultPlan
    checkpointer: Checkpointer | None


def build_run(
    cfg: TrainConfig, ctx: DistContext, attempt: int, recorder: RunRecorder
) -> TrainingRun:
    """Build data, model, optimizer, fault plan and checkpointer (all ranks, same order)."""
    layout = BatchLayout.plan(cfg.data.global_batch, cfg.data.micro_batch, ctx.world_size)
    samples = build_samples(cfg.data, cfg.model.seq_len, cfg.model.vocab_size)
    model = build_model(cfg, samples.vocab_size, ctx)
    return TrainingRun(
        model=model,
        optimizer=build_optimizer(model, cfg.optim),
        samples=samples,
        order=GlobalOrder(len(samples), cfg.data.seed),
        layout=layout,
        faults=FaultPlan.from_args_and_env(cfg.run.faults),
        checkpointer=_build_checkpointer(cfg, ctx, attempt, recorder),
    )


def _stop_if_preempted(
    preemption: PreemptionHandler,
    run: TrainingRun,
    progress: TrainProgress,
    last_saved_step: int | None,
    recorder: RunRecorder,
) -> None:
    """At a step boundary, agree across ranks on a SIGTERM; save if it fits, then stop."""
    checkpointer = run.checkpointer
    decision = None
    if preemption.requested:
        decision = preemption.decide(checkpointer.last_save_s if checkpointer else None)
    agreed = agree_on_preemption(decision)
    if agreed is None:
        return
    saved = False
    if agreed.save and checkpointer is not None and last_saved_step != progress.step:
        saved = checkpointer.save(run.model, run.optimizer, progress) is not None
    recorder.event("preempted", progress.step, reason=agreed.reason, emergency_save=saved)
    raise TrainingPreempted(progress.step, preemption.signal_name or "SIGTERM", saved)


def _train(
    cfg: TrainConfig,
    ctx: DistContext,
    attempt: int,
    recorder: RunRecorder,
    preemption: PreemptionHandler,
    stack: contextlib.ExitStack,
) -> TrainProgress:
    if cfg.run.deterministic:
        if ctx.device.type == "cuda":  # cuBLAS needs this for deterministic matmuls
            os.environ.setdefault(ENV_CUBLAS_WORKSPACE, ":4096:8")
        torch.use_deterministic_algorithms(True)
    run = build_run(cfg, ctx, attempt, recorder)
    model, optimizer, layout, checkpointer = run.model, run.optimizer, run.layout, run.checkpointer
    progress = TrainProgress()
    if ctx.is_main:
        logger.info(
            "rank 0: world_size=%d restart_count=%d global_batch=%d micro_batch=%d grad_accum=%d samples=%d",
            ctx.world_size, attempt, layout.global_batch, layout.micro, layout.accum, len(run.samples),
        )  # fmt: skip

    if checkpointer is not None and cfg.checkpoint.resume:
        if ctx.is_main:
            logger.info("rank 0: looking for a committed checkpoint under %s", checkpointer.root)
        resumed = checkpointer.resume(model, optimizer, progress)
        _report_resume(resumed, progress, attempt, recorder, ctx)
    elif checkpointer is not None:
        check_checkpoint_dir(checkpointer.root)
    progress.world_sizes.append(ctx.world_size)
    recorder.event("start", progress.step, world_size=ctx.world_size, restart_count=attempt)

    watchdog = None
    if cfg.run.watchdog_s > 0:
        dump_dir = cfg.run.run_dir or tempfile.gettempdir()
        watchdog = stack.enter_context(Watchdog(cfg.run.watchdog_s, dump_dir, rank=ctx.rank))
    stragglers = StragglerMonitor(cfg.run.straggler_every) if cfg.run.straggler_every else None

    def slow_phase() -> contextlib.AbstractContextManager[None]:
        return watchdog.allow(SLOW_PHASE_ALLOWANCE_S) if watchdog else contextlib.nullcontext()

    def on_fault(spec: FaultSpec) -> None:
        recorder.event("fault", progress.step + 1, spec=str(spec), rank=ctx.rank)

    last_saved_step = progress.step or None
    first_step = progress.step + 1
    while progress.step < cfg.run.max_steps:
        step = progress.step + 1
        run.faults.fire(step, ctx.rank, attempt, on_fire=on_fault)
        with slow_phase():
            _stop_if_preempted(preemption, run, progress, last_saved_step, recorder)

        lr = lr_at(step, cfg.optim)
        for group in optimizer.param_groups:
            group["lr"] = lr
        started = time.perf_counter()
        # The first step of an attempt warms up (allocations, gloo connections): allow more.
        with slow_phase() if step == first_step else contextlib.nullcontext():
            result = train_step(
                model, optimizer, run.samples, run.order, layout, progress, cfg, ctx
            )
        elapsed = time.perf_counter() - started
        progress.step = step
        progress.cursor += layout.global_batch
        if watchdog is not None:
            watchdog.beat(step)

        tokens_per_s = layout.global_batch * cfg.model.seq_len / max(elapsed, 1e-9)
        recorder.metrics({
            "step": step, "loss": result.loss, "lr": lr, "world_size": ctx.world_size,
            "restart_count": attempt, "tokens_per_s": tokens_per_s, "grad_norm": result.grad_norm,
            "samples_digest": samples_digest(result.sample_ids), "data_cursor": progress.cursor,
            "step_time_s": elapsed,
        })  # fmt: skip
        if ctx.is_main and (step % cfg.run.log_every == 0 or step == cfg.run.max_steps):
            logger.info(
                "rank 0 step %d/%d: loss %.4f | lr %.2e | grad_norm %.3f | %.0f tok/s",
                step, cfg.run.max_steps, result.loss, lr, result.grad_norm, tokens_per_s,
            )  # fmt: skip
        if stragglers is not None:
            report = stragglers.record(elapsed)
            if report and report["stragglers"]:
                recorder.event("stragglers", step, **report)

        every = cfg.checkpoint.every
        due = (every and step % every == 0) or step == cfg.run.max_steps
        if checkpointer is not None and due:
            fail_storage = run.faults.storage_fault_due(step, ctx.rank, attempt)
            with slow_phase():
                # The last step's save is synchronous: the run ends on a commit.
                background = step != cfg.run.max_steps
                if checkpointer.save(
                    model, optimizer, progress, fail_storage=fail_storage, background=background
                ):
                    last_saved_step = step

    if checkpointer is not None:
        checkpointer.drain()
    if cfg.run.save_final:
        path = save_final_params(model, cfg.run.run_dir, ctx)
        if path is not None:
            recorder.event("final_params", progress.step, path=path)
    recorder.event("finished", progress.step, world_size=ctx.world_size)
    return progress
