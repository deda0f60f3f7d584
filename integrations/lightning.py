"""Lightning: this project's checkpoints for a ``Trainer.fit`` run, as one ``Callback``.

    from integrations.lightning import ElasticCheckpoints

    sampler = elastic.ElasticSampler(len(dataset), global_batch=32, seed=0)
    loader = sampler.epoch_loader(dataset)            # the data position, on any world size
    trainer = pl.Trainer(
        strategy="ddp", max_steps=1000, use_distributed_sampler=False,
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
other callbacks' state (``ModelCheckpoint``, ``EarlyStopping``...), a datamodule's
``state_dict``, a precision plug-in's state (a ``GradScaler``), a training loader whose
position is not the given sampler (Lightning would replay the epoch's first batches), and
``use_distributed_sampler=True`` with a sampler (Lightning would replace it).

Exact resume needs what exact resume always needs: ``seed_everything`` before the model
is built, deterministic data (the sampler's epoch loader) and a model whose forward
draws randomness only from the RNG the manager saves (``rng=True``: each rank's).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterable
from typing import Any

import pytorch_lightning as pl

import elastic
from ckpt import CheckpointManager, CheckpointOptions, StorageOptions

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


class ElasticCheckpoints(pl.Callback):
    """A run's checkpoints and elastic hooks for ``pl.Trainer`` (usage: module docstring).

    ``root``: a local path, ``gs://`` or ``s3://`` URL. ``options``: a
    :class:`ckpt.CheckpointOptions` or its fields as keywords (``every=50,
    async_save=True``...), not both. ``sampler``: an :class:`elastic.ElasticSampler`
    (kept in the checkpoint: the data position). ``faults``: fault specs of
    :mod:`elastic.faults` (drills and tests), steps being Lightning's global steps.
    ``guard``: keyword arguments of :class:`elastic.RunGuard` (``grace_s``,
    ``watchdog_s``...). ``extra_state``: more entries for the checkpoint's state dict.
    """

    def __init__(
        self,
        root: str,
        *,
        options: CheckpointOptions | None = None,
        sampler: elastic.ElasticSampler | None = None,
        faults: Iterable[str] | str | None = None,
        guard: dict[str, Any] | None = None,
        extra_state: dict[str, Any] | None = None,
        storage_options: StorageOptions | None = None,
        seed: int = 0,
        on_event: Any = None,
        **option_kwargs: Any,
    ) -> None:
        self.root = root
        self.options = CheckpointOptions.resolve(options, option_kwargs)
        self.sampler = sampler
        self.faults = [faults] if isinstance(faults, str) else list(faults or ())
        self.guard_kwargs = dict(guard or {})
        self.extra_state = dict(extra_state or {})
        self.storage_options = storage_options
        self.seed = seed
        self.on_event = on_event
        self.manager: CheckpointManager | None = None
        """The run's manager, from ``on_fit_start`` to ``teardown``."""
        self.guard: elastic.RunGuard | None = None
        self.resumed_step: int | None = None
        """The global step the fit resumed from (None: a fresh start)."""
        self._offered_step = -1
        self._final_offered = False
        self._step_started = 0.0

    # -- start ---------------------------------------------------------------------------

    def state_of(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The checkpoint's state dict: what this callback saves and resumes."""
        state: dict[str, Any] = {"model": pl_module, "loop": LoopProgress(trainer)}
        for i, optimizer in enumerate(trainer.optimizers):
            state[f"optim{i}" if i else "optim"] = optimizer
        for i, config in enumerate(trainer.lr_scheduler_configs):
            state[f"sched{i}" if i else "sched"] = config.scheduler
        if self.sampler is not None:
            state["sampler"] = self.sampler
        clash = sorted(set(state) & set(self.extra_state))
        if clash:
            raise ValueError(f"extra_state names {clash}, which the Lightning state uses")
        state.update(self.extra_state)
        return state

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = self.state_of(trainer, pl_module)
        if self.sampler is not None:  # the sampler is the loader's position: it resumes
            warnings.filterwarnings("ignore", message=_NOT_RESUMABLE, module="pytorch_lightning")
        if trainer.is_global_zero:
            for what in self.not_kept(trainer):
                logger.warning("ElasticCheckpoints: %s", what)
        self.manager = CheckpointManager(
            self.root,
            state,
            options=self.options,
            seed=self.seed,
            storage_options=self.storage_options,
            on_event=self.on_event,
        )
        # Built now (it checks for a repeated error and shields loader workers before they
        # start), entered at on_train_start: after Lightning installed its SIGTERM handler,
        # so the guard's replaces it while training runs (Lightning's would end the fit at
        # the batch's end with no emergency checkpoint, after a collective in the handler).
        self.guard = elastic.RunGuard(
            saver=self.manager, faults=self.faults, on_event=self.on_event, **self.guard_kwargs
        )
        self.resumed_step = self.manager.resume()
        if self.resumed_step is not None and self.resumed_step != trainer.global_step:
            raise RuntimeError(
                f"the checkpoint of step {self.resumed_step} put Lightning's loop at global "
                f"step {trainer.global_step}: the loop progress and the step disagree"
            )
        self._offered_step = trainer.global_step

    def not_kept(self, trainer: pl.Trainer) -> list[str]:
        """What Lightning keeps in its own checkpoints that this callback's state does not."""
        missing = []
        for callback in trainer.callbacks:
            if callback is self:
                continue
            if callback.state_dict():
                missing.append(
                    f"the state of callback {type(callback).__name__} is not checkpointed "
                    "(it starts afresh at a resume); pass what it needs in extra_state"
                )
        datamodule = trainer.datamodule
        if datamodule is not None and datamodule.state_dict():
            missing.append(
                f"{type(datamodule).__name__}.state_dict() is not checkpointed; pass the "
                "datamodule in extra_state"
            )
        if trainer.precision_plugin.state_dict():
            missing.append(
                f"the precision plug-in's state ({type(trainer.precision_plugin).__name__}: "
                "a loss scaler) is not checkpointed"
            )
        if self.sampler is None:
            missing.append(
                "no sampler given: the data position is not checkpointed, and a resume "
                "mid-epoch replays that epoch from its first batch; pass "
                "sampler=elastic.ElasticSampler(...) and train on sampler.epoch_loader(...)"
            )
        elif trainer._accelerator_connector.use_distributed_sampler and trainer.world_size > 1:
            missing.append(
                "use_distributed_sampler=True: Lightning replaces the sampler of a "
                "DataLoader with its own, whose position is not checkpointed; set "
                "Trainer(use_distributed_sampler=False)"
            )
        return missing

    # -- steps ---------------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard is not None:
            self.guard.__enter__()
            self._before(trainer.global_step + 1)

    def _before(self, step: int) -> None:
        """The guard's hooks before ``step``: its faults, then the preemption agreement.

        Run at the end of the step before (or at the start of training): there the state
        is the one a checkpoint records (the sampler has not handed out the next batch:
        Lightning fetches a sized loader's batch only when the step starts), so an
        emergency checkpoint is the same as a periodic one of that step.
        """
        assert self.guard is not None
        self.guard.before_step(step)
        self._step_started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if self.manager is None or step == self._offered_step:
            return  # an accumulating batch: no optimizer step yet
        self._offered_step = step
        if self.guard is not None:
            self.guard.after_step(step, time.perf_counter() - self._step_started)
        self._final_offered = trainer.max_steps > 0 and step >= trainer.max_steps
        self.manager.maybe_save(step, final=self._final_offered)
        if self.guard is not None and not self._final_offered:
            self._before(step + 1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The end by max_epochs (or a stop callback): the run ends on a commit of its last step.
        if self.manager is not None and not self._final_offered and trainer.global_step > 0:
            self._final_offered = True
            self.manager.maybe_save(trainer.global_step, final=True)

    # -- end -----------------------------------------------------------------------------

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Lightning calls no teardown hook after an exception (a preemption's exit 143
        # included): close here, so a background save is drained and the root released.
        self._close(exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close(None)

    def _close(self, failure: BaseException | None) -> None:
        guard, manager = self.guard, self.manager
        self.guard = self.manager = None
        if guard is not None:  # closes the manager first; notes an error a restart repeats
            guard.__exit__(type(failure) if failure else None, failure, None)
        if manager is not None:
            manager.close()
