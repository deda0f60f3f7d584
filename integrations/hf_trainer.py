"""Hugging Face ``transformers.Trainer``: this project's checkpoints for ``trainer.train()``.

    from integrations.hf_trainer import ElasticCheckpoints

    sampler = elastic.ElasticSampler(len(dataset), global_batch=32, seed=0)
    trainer = Trainer(model=model, args=TrainingArguments(..., save_strategy="no"))
    ElasticCheckpoints("gs://bucket/run1", every=50, sampler=sampler).attach(
        trainer, sampler.epoch_loader(dataset, collate_fn=collate))
    trainer.train()                                    # resumes by itself

:meth:`ElasticCheckpoints.attach` adds the callback to the trainer and makes the given
loader the trainer's training loader (``get_train_dataloader``): the sampler is the data
position, on any world size, so the Trainer's own sampler, its sharding of batches
across processes and its skipping of batches at a resume are not used. At
``on_train_begin`` (after the model is wrapped and the optimizer and scheduler exist) the
callback builds a :class:`ckpt.CheckpointManager` over the model, the optimizer, the LR
scheduler, the sampler and the Trainer's step and epoch, resumes the newest committed
checkpoint that verifies, and starts an :class:`elastic.RunGuard` (faults, SIGTERM -> an
agreed emergency checkpoint and exit 143, watchdog, peer heartbeat). Each optimizer step
is offered to the manager at ``on_step_end``, where the guard's checks before the next
step run too; ``on_train_end`` commits the last step and closes both.

The Trainer logs a step's loss after ``on_step_end``: the step a preemption ends the run
after is committed but not logged. After a resume the Trainer counts its epochs from 0 again (its ``state.epoch`` restarts);
its ``global_step`` is the checkpoint's, so ``max_steps`` (also the one it derives from
``num_train_epochs``) ends the run at the same step with the same samples.

Said at WARNING when training starts, because a resume would lose it: the Trainer's own
checkpoints still on (``save_strategy`` not ``"no"``: they would be written beside ours
and not resumed), other callbacks' state (``TrainerState.stateful_callbacks``), a
gradient scaler (fp16) and an optimizer or scheduler of a kind this callback does not see.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import Trainer, TrainerCallback

import elastic
from elastic.sampler import EpochLoader
from integrations.steps import StepsView

__all__ = ["ElasticCheckpoints", "TrainerProgress"]

logger = logging.getLogger(__name__)


class TrainerProgress:
    """The Trainer's step and epoch as a ``Stateful`` (the same on every rank)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        state = self.trainer.state
        return {"global_step": int(state.global_step), "epoch": float(state.epoch or 0.0)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state = self.trainer.state
        state.global_step = int(saved["global_step"])
        state.epoch = float(saved["epoch"])


class ElasticCheckpoints(StepsView, TrainerCallback):
    """A run's checkpoints and elastic hooks for ``transformers.Trainer`` (usage: module
    docstring).

    ``root``: a local path, ``gs://`` or ``s3://`` URL. ``options``: a
    :class:`ckpt.CheckpointOptions` or its fields as keywords (``every=50,
    async_save=True``...), not both. ``sampler``: the :class:`elastic.ElasticSampler`
    whose ``epoch_loader`` is given to :meth:`attach` (built before the process group
    exists, it is bound to the trainer's rank and world size there). ``faults``: fault
    specs of :mod:`elastic.faults`, steps being the Trainer's global steps. ``guard``:
    keyword arguments of :class:`elastic.RunGuard`. ``extra_state``: more entries for the
    checkpoint's state dict. ``storage_options``, ``seed``, ``on_event``: the manager's.
    All of them are keywords after ``root`` (:class:`~integrations.steps.GuardedSteps`).
    """

    def __init__(self, root: str, *, sampler: elastic.ElasticSampler, **settings: Any) -> None:
        if not isinstance(sampler, elastic.ElasticSampler):
            raise TypeError(
                f"sampler must be an elastic.ElasticSampler (the data position), got "
                f"{type(sampler).__name__}"
            )
        super().__init__(root, sampler=sampler, **settings)
        self.trainer: Trainer | None = None

    def attach(self, trainer: Trainer, loader: Any) -> ElasticCheckpoints:
        """Add this callback to ``trainer`` and train it on ``loader`` (the sampler's
        ``epoch_loader``): the one call a script adds after building its Trainer."""
        sampler = self.steps.sampler
        assert sampler is not None
        if not isinstance(loader, EpochLoader) or loader.sampler is not sampler:
            raise ValueError(
                f"the loader ({type(loader).__name__}) is not this callback's sampler's "
                "epoch loader: pass sampler.epoch_loader(dataset, ...) of the sampler given "
                "to ElasticCheckpoints"
            )
        rank, world = trainer.args.process_index, trainer.args.world_size
        if (sampler.rank, sampler.world_size) != (rank, world):
            sampler.bind(rank, world)
        self.trainer = trainer
        trainer.add_callback(self)
        trainer.get_train_dataloader = lambda: _EpochLoaderForTrainer(loader)  # type: ignore[method-assign]
        return self

    # -- start ---------------------------------------------------------------------------

    def state_of(self, trainer: Trainer) -> dict[str, Any]:
        """The checkpoint's state dict: what this callback saves and resumes."""
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
        scheduler = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)
        own = {
            "model": trainer.model,
            "optim": optimizer,
            "sched": scheduler,
            "trainer": TrainerProgress(trainer),
        }
        return self.steps.state("Trainer", own)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        if trainer is None:
            raise RuntimeError(
                "ElasticCheckpoints was not attached: call callback.attach(trainer, loader) "
                "instead of passing it in Trainer(callbacks=...)"
            )
        if state.is_world_process_zero:
            for what in self.not_kept(trainer):
                logger.warning("ElasticCheckpoints: %s", what)
        self.steps.open(self.state_of(trainer))
        if self.steps.resume() is not None:
            # The Trainer set these from step 0 before this hook: its logged loss averages
            # over the steps since the last log, its train_loss over the steps of this
            # call, and a resume moved both starting points.
            trainer._globalstep_last_logged = state.global_step
            trainer._initial_global_step = state.global_step
        self.steps.start(state.global_step)

    def not_kept(self, trainer: Trainer) -> list[str]:
        """What the Trainer keeps in its own checkpoints that this callback's state does not."""
        args = trainer.args
        missing = []
        if str(getattr(args.save_strategy, "value", args.save_strategy)) != "no":
            missing.append(
                f"save_strategy={args.save_strategy!r}: the Trainer also writes its own "
                f"checkpoints under {args.output_dir}, which a resume does not read; set "
                "TrainingArguments(save_strategy='no')"
            )
        kept = [id(value) for value in self.steps.extra_state.values()]
        for callback in trainer.callback_handler.callbacks:
            if callback is self or id(callback) in kept:
                continue
            if callable(getattr(callback, "state", None)) and callback.state():
                missing.append(
                    f"the state of callback {type(callback).__name__} is not checkpointed "
                    "(it starts afresh at a resume); pass what it needs in extra_state"
                )
        if getattr(trainer.accelerator, "scaler", None) is not None:
            missing.append("the fp16 gradient scaler is not checkpointed")
        return missing

    # -- steps ---------------------------------------------------------------------------

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.after(state.global_step, last_step=state.max_steps)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.finish(state.global_step)
        self.steps.close(None)


class _EpochLoaderForTrainer:
    """The sampler's epoch loader as the Trainer iterates it.

    The Trainer calls ``set_epoch`` with its own epoch count, which restarts at 0 after a
    resume; the sampler's cursor knows the epoch, so that call is not passed on.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.dataset = loader.dataloader.dataset  # what the Trainer counts examples in

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        return iter(self.loader)
