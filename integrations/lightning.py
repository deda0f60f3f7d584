"""Lightning: this project's checkpoints for a ``Trainer.fit`` run, as one ``Callback``.

    from integrations.lightning import ElasticCheckpoints

    sampler = elastic.ElasticSampler(len(dataset), global_batch=32, seed=0)
    loader = sampler.epoch_loader(dataset)            # the data position, on any world size
    trainer = pl.Trainer(
        strategy="ddp", max_steps=1000,
        enable_checkpointing=False,                    # ours replaces ModelCheckpoint
        callbacks=[ElasticCheckpoints("gs://bucket/run1", every=50, sampler=sampler)],
    )
    trainer.fit(model, train_dataloaders=loader)      # resumes by itself; no ckpt_path

At ``on_fit_start`` (after the strategy set up the process group, the wrapped model and
the optimizers) it builds a :class:`ckpt.CheckpointManager` over the ``LightningModule``,
every optimizer and LR scheduler, Lightning's fit-loop progress (epoch, batch, global
step: ``trainer.fit_loop.state_dict()``) and the sampler; then it resumes the newest
committed checkpoint that verifies, on any world size, and hands the loop progress back
to Lightning the way its own ``ckpt_path`` restore does. At ``on_train_start`` an
:class:`elastic.RunGuard` takes over (faults, SIGTERM -> an agreed emergency checkpoint
and exit 143, watchdog, peer heartbeat): its SIGTERM handler replaces Lightning's while
training runs. Each optimizer step is offered to the manager at ``on_train_batch_end``
(where Lightning's own ``ModelCheckpoint`` saves, so the loop progress recorded is the
one Lightning's restart expects), and the guard's checks before the next step run there
too; the end of training saves the final step, and ``teardown`` (or ``on_exception``)
closes both.

What Lightning keeps and this state does not is said at WARNING when the fit starts:
Lightning's own ``ModelCheckpoint`` still on, other callbacks' state (``EarlyStopping``...)
unless given in ``extra_state``, a datamodule's ``state_dict``, a precision plug-in's
state (a ``GradScaler``), no sampler (a resume would replay the epoch's first batches).
Refused before the first step: ``fit(ckpt_path=...)`` (a second checkpoint restored over
the one resumed), a training loader that is not the given sampler's ``epoch_loader`` (its
position would not move), and an epoch loader whose sampler was not given.

Lightning's global step counts optimizer steps: a manual-optimization module that steps
two optimizers per batch moves it by 2, and the checkpoint policy and fault steps count
the same way.

Exact resume needs what exact resume always needs: ``seed_everything`` before the model
is built, deterministic data (the sampler's epoch loader) and a model whose forward
draws randomness only from the RNG the manager saves (``rng=True``: each rank's).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytorch_lightning as pl

from elastic.sampler import EpochLoader
from integrations.steps import StepsView

__all__ = ["ElasticCheckpoints", "LoopProgress"]

logger = logging.getLogger(__name__)

_LOADER_STATE = "combined_loader"
"""Where Lightning's fit loop keeps stateful loaders' states (each rank's own)."""


_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"
"""Lightning's warning for a mid-epoch resume of a loader without ``state_dict``: not
true of a loader driven by the sampler this callback checkpoints."""


class LoopProgress:
    """Lightning's fit-loop progress as a ``Stateful`` (the same on every rank).

    Loading it is what Lightning's own ``ckpt_path`` restore does with a checkpoint's
    ``loops.fit_loop``: the loop restarts at the batch after the one saved.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        state = self.trainer.fit_loop.state_dict()
        # A stateful loader's position is per rank and per world size: not ours to keep
        # (the sampler is the data position); said when the fit starts.
        state.get("state_dict", {}).pop(_LOADER_STATE, None)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.fit_loop.load_state_dict(state)


class ElasticCheckpoints(StepsView, pl.Callback):
    """A run's checkpoints and elastic hooks for ``pl.Trainer`` (usage: module docstring).

    ``root``: a local path, ``gs://`` or ``s3://`` URL. ``options``: a
    :class:`ckpt.CheckpointOptions` or its fields as keywords (``every=50,
    async_save=True``...), not both. ``sampler``: an :class:`elastic.ElasticSampler` whose
    ``epoch_loader`` the fit trains on (kept in the checkpoint: the data position; built
    before the process group exists, it is bound to the trainer's rank and world size).
    ``faults``: fault specs of :mod:`elastic.faults` (drills and tests), steps being
    Lightning's global steps. ``guard``: keyword arguments of :class:`elastic.RunGuard`
    (``grace_s``, ``watchdog_s``...). ``extra_state``: more entries for the checkpoint's
    state dict (another callback's state, for one). ``storage_options``, ``seed``,
    ``on_event``: the manager's. All of them are keywords after ``root``
    (:class:`~integrations.steps.GuardedSteps`).
    """


    # -- start ---------------------------------------------------------------------------

    def state_of(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The checkpoint's state dict: what this callback saves and resumes."""
        own: dict[str, Any] = {"model": pl_module, "loop": LoopProgress(trainer)}
        for i, optimizer in enumerate(trainer.optimizers):
            own[f"optim{i}" if i else "optim"] = optimizer
        for i, config in enumerate(trainer.lr_scheduler_configs):
            own[f"sched{i}" if i else "sched"] = config.scheduler
        return self.steps.state("Lightning", own)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path is not None:  # read by Lightning already; nothing trained yet
            raise ValueError(
                f"trainer.fit(ckpt_path={trainer.ckpt_path!r}) with ElasticCheckpoints: the "
                f"callback resumes by itself from {self.steps.root}, and Lightning would "
                "restore a second checkpoint over it; drop ckpt_path (to start from a "
                "Lightning .ckpt, load its state_dict into the model before fit)"
            )
        sampler = self.steps.sampler
        if sampler is not None:
            # the sampler is the loader's position: it resumes (Lightning's warning is not true)
            warnings.filterwarnings("ignore", message=_NOT_RESUMABLE, module="pytorch_lightning")
            if (sampler.rank, sampler.world_size) != (trainer.global_rank, trainer.world_size):
                sampler.bind(trainer.global_rank, trainer.world_size)
        if trainer.is_global_zero:
            for what in self.not_kept(trainer):
                logger.warning("ElasticCheckpoints: %s", what)
        self.steps.open(self.state_of(trainer, pl_module))
        step = self.steps.resume()
        if step is not None and step != trainer.global_step:
            raise RuntimeError(
                f"the checkpoint of step {step} put Lightning's loop at global step "
                f"{trainer.global_step}: the loop progress and the step disagree"
            )

    def not_kept(self, trainer: pl.Trainer) -> list[str]:
        """What Lightning keeps in its own checkpoints that this callback's state does not."""
        missing = []
        kept = [id(value) for value in self.steps.extra_state.values()]
        for callback in trainer.callbacks:
            if callback is self or id(callback) in kept:
                continue
            if isinstance(callback, pl.callbacks.ModelCheckpoint):
                missing.append(
                    "Lightning's ModelCheckpoint is on: it writes .ckpt files of its own, which "
                    "a resume does not read; set Trainer(enable_checkpointing=False)"
                )
            elif callback.state_dict():
                missing.append(
                    f"the state of callback {type(callback).__name__} is not checkpointed "
                    "(it starts afresh at a resume); pass it in extra_state (docs/adoption.md, "
                    "Lightning)"
                )
        datamodule = trainer.datamodule
        if datamodule is not None and datamodule.state_dict() and id(datamodule) not in kept:
            missing.append(
                f"{type(datamodule).__name__}.state_dict() is not checkpointed; pass the "
                "datamodule in extra_state"
            )
        if trainer.precision_plugin.state_dict():
            missing.append(
                f"the precision plug-in's state ({type(trainer.precision_plugin).__name__}: "
                "a loss scaler) is not checkpointed"
            )
        if self.steps.sampler is None:
            missing.append(
                "no sampler given: the data position is not checkpointed, and a resume "
                "mid-epoch replays that epoch from its first batch; pass "
                "sampler=elastic.ElasticSampler(...) and train on sampler.epoch_loader(...)"
            )
        return missing

    # -- steps ---------------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning installed its SIGTERM handler (at the end of its set-up): the
        # guard's replaces it while training runs. Lightning's would end the fit at the
        # batch's end with no emergency checkpoint, after a collective in the handler.
        self._check_loader(trainer.train_dataloader)
        self.steps.start(trainer.global_step)

    def _check_loader(self, loader: Any) -> None:
        """The fit trains on the sampler's epoch loader (refused otherwise, before a step)."""
        sampler = self.steps.sampler
        if isinstance(loader, EpochLoader):
            if sampler is None:
                raise ValueError(
                    "the fit trains on an ElasticSampler's epoch_loader, but ElasticCheckpoints "
                    "was given no sampler: pass sampler=<that sampler>, so the data position "
                    "is checkpointed"
                )
            if loader.sampler is not sampler:
                raise ValueError(
                    "the fit trains on the epoch_loader of another ElasticSampler than the one "
                    "given to ElasticCheckpoints: pass the loader's sampler"
                )
        elif sampler is not None:
            raise ValueError(
                f"the fit trains on a {type(loader).__name__}, not on the epoch loader of the "
                "sampler given to ElasticCheckpoints, so its position would not move with "
                "training: train on sampler.epoch_loader(dataset, ...)"
            )

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        # Where Lightning's ModelCheckpoint saves: the loop progress its restart expects.
        self.steps.after(trainer.global_step, last_step=trainer.max_steps)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps.finish(trainer.global_step)  # the end by max_epochs or a stop callback

    # -- end -----------------------------------------------------------------------------

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Lightning calls no teardown hook after an exception (a preemption's exit 143
        # included): close here, so a background save is drained and the root released.
        self.steps.close(exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.steps.close(None)
