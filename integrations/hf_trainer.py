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
import time
from collections.abc import Iterable
from typing import Any

from transformers import Trainer, TrainerCallback

import elastic
from ckpt import CheckpointManager, CheckpointOptions, StorageOptions

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


class ElasticCheckpoints(TrainerCallback):
    """A run's checkpoints and elastic hooks for ``transformers.Trainer`` (usage: module
    docstring).

    ``root``: a local path, ``gs://`` or ``s3://`` URL. ``options``: a
    :class:`ckpt.CheckpointOptions` or its fields as keywords (``every=50,
    async_save=True``...), not both. ``sampler``: the :class:`elastic.ElasticSampler`
    behind the loader given to :meth:`attach`. ``faults``: fault specs of
    :mod:`elastic.faults`, steps being the Trainer's global steps. ``guard``: keyword
    arguments of :class:`elastic.RunGuard`. ``extra_state``: more entries for the
    checkpoint's state dict.
    """

    def __init__(
        self,
        root: str,
        *,
        sampler: elastic.ElasticSampler,
        options: CheckpointOptions | None = None,
        faults: Iterable[str] | str | None = None,
        guard: dict[str, Any] | None = None,
        extra_state: dict[str, Any] | None = None,
        storage_options: StorageOptions | None = None,
        seed: int = 0,
        on_event: Any = None,
        **option_kwargs: Any,
    ) -> None:
        if not callable(getattr(sampler, "epoch_loader", None)):
            raise TypeError(
                f"sampler must be an elastic.ElasticSampler (the data position), got "
                f"{type(sampler).__name__}"
            )
        self.root = root
        self.options = CheckpointOptions.resolve(options, option_kwargs)
        self.sampler = sampler
        self.faults = [faults] if isinstance(faults, str) else list(faults or ())
        self.guard_kwargs = dict(guard or {})
        self.extra_state = dict(extra_state or {})
        self.storage_options = storage_options
        self.seed = seed
        self.on_event = on_event
        self.trainer: Trainer | None = None
        self.manager: CheckpointManager | None = None
        """The run's manager, from ``on_train_begin`` to ``on_train_end``."""
        self.guard: elastic.RunGuard | None = None
        self.resumed_step: int | None = None
        """The global step the run resumed from (None: a fresh start)."""
        self._offered_step = -1
        self._step_started = 0.0

    def attach(self, trainer: Trainer, loader: Any) -> ElasticCheckpoints:
        """Add this callback to ``trainer`` and train it on ``loader`` (the sampler's
        ``epoch_loader``): the one call a script adds after building its Trainer."""
        if getattr(loader, "sampler", None) is not self.sampler:
            raise ValueError(
                "the loader is not this callback's sampler's: pass "
                "sampler.epoch_loader(dataset, ...) of the sampler given to ElasticCheckpoints"
            )
        self.trainer = trainer
        trainer.add_callback(self)
        trainer.get_train_dataloader = lambda: _EpochLoaderForTrainer(loader)  # type: ignore[method-assign]
        return self

    # -- start ---------------------------------------------------------------------------

    def state_of(self, trainer: Trainer) -> dict[str, Any]:
        """The checkpoint's state dict: what this callback saves and resumes."""
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
        scheduler = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)
        state: dict[str, Any] = {
            "model": trainer.model,
            "optim": optimizer,
            "sched": scheduler,
            "sampler": self.sampler,
            "trainer": TrainerProgress(trainer),
        }
        clash = sorted(set(state) & set(self.extra_state))
        if clash:
            raise ValueError(f"extra_state names {clash}, which the Trainer state uses")
        state.update(self.extra_state)
        return state

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
        self.manager = CheckpointManager(
            self.root,
            self.state_of(trainer),
            options=self.options,
            seed=self.seed,
            storage_options=self.storage_options,
            on_event=self.on_event,
        )
        self.guard = elastic.RunGuard(
            saver=self.manager, faults=self.faults, on_event=self.on_event, **self.guard_kwargs
        )
        self.guard.__enter__()
        try:
            self.resumed_step = self.manager.resume()
        except BaseException as exc:
            self._close(exc)
            raise
        if self.resumed_step is not None:
            # The Trainer set these from step 0 before this hook: its logged loss averages
            # over the steps since the last log, its train_loss over the steps of this
            # call, and a resume moved both starting points.
            trainer._globalstep_last_logged = state.global_step
            trainer._initial_global_step = state.global_step
        self._offered_step = state.global_step
        self._before(state.global_step + 1)

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
        for callback in trainer.callback_handler.callbacks:
            if callback is self:
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

    def _before(self, step: int) -> None:
        """The guard's hooks before ``step`` (faults, then the preemption agreement), run at
        the end of the step before: there the state is the one a checkpoint records."""
        if self.guard is None:
            return
        try:
            self.guard.before_step(step)
        except BaseException as exc:  # a preemption's exit, an injected fault
            self._close(exc)
            raise
        self._step_started = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        if self.manager is None or step == self._offered_step:
            return
        self._offered_step = step
        if self.guard is not None:
            self.guard.after_step(step, time.perf_counter() - self._step_started)
        final = state.max_steps > 0 and step >= state.max_steps
        self.manager.maybe_save(step, final=final)
        if not final:
            self._before(step + 1)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.manager is not None and state.global_step > 0:
            if self.manager.last_committed_step != state.global_step:
                self.manager.wait()  # an async save of this very step commits it
            if self.manager.last_committed_step != state.global_step:
                self.manager.maybe_save(state.global_step, final=True)
        self._close(None)

    def _close(self, failure: BaseException | None) -> None:
        guard, manager = self.guard, self.manager
        self.guard = self.manager = None
        if guard is not None:  # closes the manager first; notes an error a restart repeats
            guard.__exit__(type(failure) if failure else None, failure, None)
        if manager is not None:
            manager.close()


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
