"""The training loop: build the pieces, resume, train step by step, checkpoint, record.

Reads top to bottom like nanoGPT's train.py; construction lives in builders
(``build_samples``, ``build_model``, ``build_optimizer``). The trainer is the first user
of the public API: saving and resuming is ``ckpt.CheckpointManager``, the elastic hooks
(fault injection, SIGTERM and emergency saves, watchdog, stragglers) are
``elastic.RunGuard``. Every rank runs ``train`` with the same config.

Step numbering: step ``S`` is the S-th optimizer step (1-based). Faults for step ``S`` and
preemption checks run at the start of step ``S``, before any compute, so "kill at step 5"
leaves steps 1..4 completed.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ckpt import CheckpointManager
from elastic.events import RunRecorder
from elastic.faults import fire_at_point
from elastic.guard import RunGuard
from elastic.heartbeat import first_beat_bound_s
from elastic.sampler import ElasticSampler
from runcore import events as ev
from runcore.errors import JobEndingError
from trainer.build import build_model, build_optimizer
from trainer.config import TrainConfig
from trainer.data import BatchLayout, TokenSamples, build_samples, samples_digest
from trainer.distributed import DistContext
from trainer.schedule import lr_at
from trainer.shard_local import clip_grad_norm

logger = logging.getLogger(__name__)

FINAL_PARAMS_FILE = "final_params.pt"
ENV_CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
"""Set (if unset) before CUDA work when ``run.deterministic``; a user's value wins."""
METADATA_VERSION = 2
"""2: step and data position are checkpointed state (``train``, ``sampler``), not metadata."""


class ResumePastEndError(ValueError, JobEndingError):
    """A new launch resumed at or past ``run.max_steps``: nothing to train (exit 1, no
    restart retries it); ``run.allow_resume_past_end`` accepts it."""


@dataclass(slots=True, kw_only=True)
class TrainProgress:
    """Optimizer steps done and the world sizes that trained (checkpointed: ``Stateful``).

    The data position is the ``ElasticSampler``'s (checkpointed next to it): the
    global samples consumed, ``step * global_batch``.
    """

    step: int = 0
    """Optimizer steps completed (the next step is ``step + 1``)."""
    world_sizes: list[int] = field(default_factory=list)
    """World size of each attempt that trained, in order (for diagnosis)."""

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "world_sizes": list(self.world_sizes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.world_sizes = [int(w) for w in state["world_sizes"]]


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
    sampler: ElasticSampler,
    layout: BatchLayout,
    cfg: TrainConfig,
    ctx: DistContext,
) -> StepResult:
    """One optimizer step over the sampler's global batch (collective; the caller advances it).

    The loss is the sum of per-sample losses divided by the global batch; gradients are
    SUM-reduced across ranks, so the update is the same at every world size.
    """
    model.train()
    local = sampler.local_batch_ids()
    micro_batches = sampler.micro_batches(layout.micro)
    local_ids = [local[mb.local] for mb in micro_batches]
    loss_sum = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for k, (mb, ids) in enumerate(zip(micro_batches, local_ids, strict=True)):
        inputs, targets = samples.get(ids)
        inputs, targets = inputs.to(ctx.device), targets.to(ctx.device)
        model.set_requires_gradient_sync(k == layout.accum - 1)  # reduce once, after the last
        # Dropout keyed by the global micro-batch index, never the rank: the same masks on
        # every world size; the process RNG outside the scope is left as it was.
        with mb.rng(cfg.run.seed):
            per_sample = model(inputs, targets)
            (per_sample.sum() / layout.global_batch).backward()
        loss_sum += per_sample.detach().sum()
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    grad_norm = clip_grad_norm(model.parameters(), max_norm)  # on the shards, one all-reduce
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

    Raises ``elastic.Preempted`` after a SIGTERM (the entry point turns it into an exit code).
    """
    recorder = RunRecorder(cfg.run.run_dir, rank=ctx.rank)
    try:
        return _train(cfg, ctx, recorder)
    finally:
        recorder.close()


@dataclass(frozen=True, slots=True)
class TrainingRun:
    """Everything built for one attempt: the same on every rank except the shards."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    samples: TokenSamples
    sampler: ElasticSampler
    """The data position: the job's global sample order and cursor (checkpointed)."""
    layout: BatchLayout


def build_run(cfg: TrainConfig, ctx: DistContext) -> TrainingRun:
    """Build data, model and optimizer (all ranks, same order)."""
    layout = BatchLayout.plan(cfg.data.global_batch, cfg.data.micro_batch, ctx.world_size)
    samples = build_samples(cfg.data, cfg.model.seq_len, cfg.model.vocab_size)
    model = build_model(cfg, samples.vocab_size, ctx)
    return TrainingRun(
        model=model,
        optimizer=build_optimizer(model, cfg.optim),
        samples=samples,
        sampler=ElasticSampler(
            len(samples),
            cfg.data.global_batch,
            seed=cfg.data.seed,
            rank=ctx.rank,
            world_size=ctx.world_size,
        ),
        layout=layout,
    )


def build_checkpoints(
    cfg: TrainConfig,
    ctx: DistContext,
    run: TrainingRun,
    progress: TrainProgress,
    attempt: int,
    recorder: RunRecorder,
) -> CheckpointManager | None:
    """The checkpoint manager of this attempt (None without ``checkpoint.dir``); collective.

    The checkpointed objects are the model, the optimizer, the sampler (data position)
    and the progress (step, world sizes): a resume puts each back, nothing is read from
    metadata. The manifest's metadata says what identifies the run (seeds, global
    batch, model digest) for a reader of the checkpoint.
    """
    if not cfg.checkpoint.dir:
        return None

    def metadata(step: int) -> dict[str, Any]:
        return {
            "trainer_metadata_version": METADATA_VERSION,
            "lr_schedule": {"kind": "warmup_cosine", "step": step},
            "world_size": ctx.world_size,
            "seed": cfg.run.seed,
            "data_seed": cfg.data.seed,
            "global_batch": cfg.data.global_batch,
            "model_digest": cfg.model_digest(),
            "config_digests": cfg.section_digests(),
            "restart_count": attempt,
        }

    def on_event(name: str, step: int, **fields: Any) -> None:
        if name == ev.RESUME:  # the sampler is loaded when the resume is reported
            fields["data_cursor"] = run.sampler.cursor
            fields["restart_count"] = attempt
        recorder.event(name, step, **fields)

    # A rank that died during the start-up ends the others' wait for the group within
    # the peer failure detector's bound (peer timeout + its grace for a first beat).
    setup_timeout_s = cfg.checkpoint.setup_timeout_s
    if setup_timeout_s is None:
        setup_timeout_s = first_beat_bound_s(cfg.run.peer_timeout_s)
    options = replace(cfg.checkpoint.options(), setup_timeout_s=setup_timeout_s)
    return CheckpointManager(
        cfg.checkpoint.dir,
        {"model": run.model, "optim": run.optimizer, "sampler": run.sampler, "train": progress},
        options=options,
        seed=cfg.run.seed,
        metadata=metadata,
        on_event=on_event,
    )


def resume(
    manager: CheckpointManager, run: TrainingRun, cfg: TrainConfig, ctx: DistContext
) -> None:
    """Resume from the newest committed checkpoint, or check the root is usable (collective).

    With ``checkpoint.resume = "must"`` a root without a committed checkpoint is an
    error; otherwise the manager says at WARNING that the run starts from step 0. With
    ``checkpoint.resume = false`` the job does not resume at its start, but a torchrun
    restart of it resumes the checkpoints it wrote itself (``this_job_only``): starting
    over would collide with them (``CheckpointExistsError``) and lose its steps.
    """
    if not cfg.checkpoint.resume:
        step = manager.resume(this_job_only=True)
        if step is not None and ctx.is_main:
            logger.info("rank 0: restart of this job: data cursor %d after step %d",
                        run.sampler.cursor, step)  # fmt: skip
        return
    if ctx.is_main:
        logger.info("rank 0: looking for a committed checkpoint under %s", manager.root)
    step = manager.resume(must=cfg.checkpoint.resume == "must")
    if step is not None and ctx.is_main:  # the manager said the resume itself at WARNING
        logger.info("rank 0: data cursor %d after step %d", run.sampler.cursor, step)
    if step is not None and ctx.is_main and manager.last_resume is not None:
        _say_other_config(manager.last_resume.metadata, step, cfg)
    if step is not None and step >= cfg.run.max_steps:
        _resumed_past_end(manager, step, cfg, ctx)


def _say_other_config(metadata: dict[str, Any], step: int, cfg: TrainConfig) -> None:
    """WARNING when the resumed checkpoint was written with other model, data or optim
    settings: another job's checkpoint under the same root, or a changed config."""
    saved = metadata.get("config_digests")
    if not isinstance(saved, dict):
        return
    differ = [name for name, digest in cfg.section_digests().items() if saved.get(name) != digest]
    if differ:
        logger.warning(
            "rank 0: resumed step %d, written with other %s settings than this run's: "
            "another job's checkpoint under the same root, or a changed configuration; "
            "if not meant, stop and check --ckpt-dir",
            step, " and ".join(differ),
        )  # fmt: skip


def _resumed_past_end(
    manager: CheckpointManager, step: int, cfg: TrainConfig, ctx: DistContext
) -> None:
    """A resume at or past ``max_steps``: nothing to train. Fine for a restart of this job
    (it had finished); a new launch says so and stops, unless asked, since the checkpoint
    may be another job's and an exit 0 would pass for this job's success."""
    where = f"step {step} of {manager.root}, at or past run.max_steps={cfg.run.max_steps}"
    if ctx.attempt > 0 or cfg.run.allow_resume_past_end:
        if ctx.is_main:
            logger.warning("rank 0: resumed %s: nothing left to train", where)
        return
    raise ResumePastEndError(
        f"resumed {where}: this launch has nothing to train (the checkpoint may be another "
        "job's, or this run already finished); raise --max-steps to train further, pass "
        "--set run.allow_resume_past_end=true to accept it, or use another --ckpt-dir"
    )


def _train(cfg: TrainConfig, ctx: DistContext, recorder: RunRecorder) -> TrainProgress:
    if cfg.run.deterministic:
        if ctx.device.type == "cuda":  # cuBLAS needs this for deterministic matmuls
            os.environ.setdefault(ENV_CUBLAS_WORKSPACE, ":4096:8")
        torch.use_deterministic_algorithms(True)
    run = build_run(cfg, ctx)
    model, optimizer, layout = run.model, run.optimizer, run.layout
    progress = TrainProgress()
    attempt = ctx.attempt
    if ctx.is_main:
        logger.info(
            "rank 0: world_size=%d restart_count=%d global_batch=%d micro_batch=%d grad_accum=%d samples=%d",
            ctx.world_size, attempt, layout.global_batch, layout.micro, layout.accum, len(run.samples),
        )  # fmt: skip

    def fault_point(point: str) -> None:  # faults planned at a start-up point (tests, drills)
        def record(spec: Any) -> None:
            recorder.event(ev.FAULT, 0, every_rank=True, spec=str(spec), rank=ctx.rank)

        fire_at_point(point, ctx.rank, attempt, cfg.run.faults, on_fire=record)

    fault_point("checkpoint_manager")
    manager = build_checkpoints(cfg, ctx, run, progress, attempt, recorder)
    guard = RunGuard(
        saver=manager,
        faults=cfg.run.faults,
        on_event=recorder.event,
        watchdog_s=cfg.run.watchdog_s,
        dump_dir=cfg.run.run_dir or None,
        straggler_every=cfg.run.straggler_every,
        heartbeat_s=cfg.run.heartbeat_s,
        peer_timeout_s=cfg.run.peer_timeout_s,
        node_timeout_s=cfg.run.node_timeout_s,
        stall_limit_s=cfg.run.peer_stall_limit_s,
        attempt=attempt,
        divergence=cfg.run.divergence,
        rollback_skip=cfg.run.rollback_skip,
        max_rollbacks=cfg.run.max_rollbacks,
        sampler=run.sampler,
    )
    with guard:  # closes the manager on exit (the drain stays guarded)
        if manager is not None:
            fault_point("resume")
            with guard.slow_phase():
                resume(manager, run, cfg, ctx)
        progress.world_sizes.append(ctx.world_size)
        recorder.event(ev.START, progress.step, world_size=ctx.world_size, restart_count=attempt)

        for step in guard.steps(progress.step, cfg.run.max_steps):
            lr = lr_at(step, cfg.optim)
            for group in optimizer.param_groups:
                group["lr"] = lr
            started = time.perf_counter()
            result = train_step(model, optimizer, run.samples, run.sampler, layout, cfg, ctx)
            elapsed = time.perf_counter() - started
            guard.record_step_time(elapsed)
            # A NaN loss stops the run or rolls it back (run.divergence), before it is saved.
            if guard.check(result.loss, reduced=True):
                continue  # rolled back: the guard's steps go on after the restored step
            progress.step = step
            run.sampler.advance()

            tokens_per_s = layout.global_batch * cfg.model.seq_len / max(elapsed, 1e-9)
            recorder.metrics({
                "step": step, "loss": result.loss, "lr": lr, "world_size": ctx.world_size,
                "restart_count": attempt, "tokens_per_s": tokens_per_s, "grad_norm": result.grad_norm,
                "samples_digest": samples_digest(result.sample_ids), "data_cursor": run.sampler.cursor,
                "step_time_s": elapsed,
            })  # fmt: skip
            if ctx.is_main and (step % cfg.run.log_every == 0 or step == cfg.run.max_steps):
                logger.info(
                    "rank 0 step %d/%d: loss %.4f | lr %.2e | grad_norm %.3f | %.0f tok/s",
                    step, cfg.run.max_steps, result.loss, lr, result.grad_norm, tokens_per_s,
                )  # fmt: skip
            if manager is not None:
                with guard.slow_phase():
                    # The last step's save is synchronous: the run ends on a commit.
                    manager.maybe_save(step, final=step == cfg.run.max_steps)

        if manager is not None:
            manager.wait()
    if cfg.run.save_final:
        path = save_final_params(model, cfg.run.run_dir, ctx)
        if path is not None:
            recorder.event(ev.FINAL_PARAMS, progress.step, path=path)
    recorder.event(ev.FINISHED, progress.step, world_size=ctx.world_size)
    return progress
