"""Resumable training state through the ``ckpt`` library: save, find, verify shape, load.

State saved: model and optimizer (sharded, via ``get_state_dict``), this rank's RNG under
``rng/rank_{r}``, and in the manifest's user metadata the step, the global data cursor,
the LR schedule position, the parameter shapes and the world-size history. All functions
here are collectives: every rank calls them, in the same order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckpt
from ckpt import faults as storage_faults
from trainer.consensus import first_error
from trainer.distributed import DistContext
from trainer.rng import capture_rng, reseed_process, restore_rng, rng_key

logger = logging.getLogger(__name__)

METADATA_VERSION = 1


class CheckpointDirError(RuntimeError):
    """The checkpoint directory cannot be created or listed."""


class CheckpointShapeError(RuntimeError):
    """The checkpoint was written for a model of another shape."""


@dataclass(slots=True, kw_only=True)
class TrainProgress:
    """Where training stands: optimizer steps done and global samples consumed."""

    step: int = 0
    """Optimizer steps completed (the next step is ``step + 1``)."""
    cursor: int = 0
    """Global data cursor: samples consumed by the whole job."""
    world_sizes: list[int] = field(default_factory=list)
    """World size of each attempt that trained, in order (for diagnosis)."""


@dataclass(frozen=True, slots=True)
class ResumeInfo:
    """What a resume restored, for logs and events."""

    step: int
    url: str
    old_world_size: int
    new_world_size: int
    rng_restored: bool
    bytes_read: int
    duration_s: float


EventSink = Callable[[dict[str, Any]], None]


def check_checkpoint_dir(root: str) -> None:
    """Fail early, on every rank together, when ``root`` cannot be used (collective).

    A local root is created; any root is listed through ``ckpt.Storage`` (bounded by its
    timeouts and retries), so a bad scheme, a path under a file, or missing permissions
    surface here as ``CheckpointDirError`` instead of at the first save.
    """
    error = None
    try:
        storage = ckpt.Storage(root)
        if isinstance(storage.fs, LocalFileSystem):
            storage.fs.makedirs(storage.path(), exist_ok=True)
        storage.list_dir()
        storage.check_reachable()  # a missing bucket lists as empty
    except Exception as exc:  # any failure means the directory is unusable
        error = f"--ckpt-dir {root!r} is not reachable or writable: {type(exc).__name__}: {exc}"
    error = first_error(error)
    if error is not None:
        raise CheckpointDirError(f"{error} [fix the path/URL or credentials, or omit --ckpt-dir]")


def param_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """Global (unsharded) shape of every model state-dict tensor, by name."""
    return {name: list(t.shape) for name, t in model.state_dict().items()}


def shape_mismatch(expected: dict[str, list[int]], saved: dict[str, list[int]]) -> str | None:
    """Describe the first tensor whose shape differs (or that one side lacks), else None."""
    for name, shape in expected.items():
        if name not in saved:
            return f"tensor {name!r} (shape {shape}) is missing from the checkpoint"
        if list(saved[name]) != shape:
            return f"tensor {name!r} has shape {list(saved[name])} in the checkpoint but {shape} in this model"
    for name, shape in saved.items():
        if name not in expected:
            return f"the checkpoint has tensor {name!r} (shape {list(shape)}) that this model lacks"
    return None


def save_checkpoint(
    root: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    progress: TrainProgress,
    ctx: DistContext,
    *,
    extra_metadata: dict[str, Any],
    on_event: EventSink | None = None,
    async_save: bool = False,
) -> str:
    """Write a committed checkpoint of ``progress.step`` under ``root``; returns its URL.

    With ``async_save`` it returns once the state is staged; the commit happens in the
    background and a failure surfaces at the next save or at :func:`ckpt.close`.
    """
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "rng": {rng_key(ctx.rank): capture_rng(ctx.device)},
    }
    metadata = {
        "trainer_metadata_version": METADATA_VERSION,
        "step": progress.step,
        "data_cursor": progress.cursor,
        "lr_schedule": {"kind": "warmup_cosine", "step": progress.step},
        "world_size": ctx.world_size,
        "world_sizes": progress.world_sizes,
        "param_shapes": param_shapes(model),
        **extra_metadata,
    }
    if not async_save:
        return ckpt.save(state, root, progress.step, metadata=metadata, on_event=on_event)
    # The staging copy overlaps the next forward/backward; the optimizer's next step()
    # waits for it (nothing else in the loop changes parameters or optimizer state).
    pending = ckpt.save(
        state,
        root,
        progress.step,
        metadata=metadata,
        on_event=on_event,
        async_save=True,
        overlap_staging=optimizer,
    )
    return pending.url


def _check_shapes_before_load(latest: ckpt.CheckpointInfo | None, model: torch.nn.Module) -> None:
    """Compare the newest committed checkpoint's recorded shapes with ``model`` (collective)."""
    error = None
    if latest is not None and latest.manifest is not None:
        saved = latest.manifest.metadata.get("param_shapes")
        if isinstance(saved, dict):
            problem = shape_mismatch(param_shapes(model), saved)
            if problem is not None:
                error = (
                    f"checkpoint {latest.url} (step {latest.step}) was written for a different model: "
                    f"{problem}; use the [model] config it was trained with, or another --ckpt-dir"
                )
    error = first_error(error)
    if error is not None:
        raise CheckpointShapeError(error)


def load_latest(
    root: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    progress: TrainProgress,
    ctx: DistContext,
    *,
    seed: int,
    on_event: EventSink | None = None,
) -> ResumeInfo | None:
    """Restore from the newest loadable committed checkpoint under ``root``, or return None.

    Model and optimizer reshard through DCP on any world size. This rank's RNG is
    restored only when the world size is unchanged; otherwise it is re-derived from
    (seed, step, rank). Raises ``CheckpointShapeError`` for a checkpoint of another model.
    """
    latest = ckpt.find_latest_committed(root)
    _check_shapes_before_load(latest, model)
    if latest is None or latest.manifest is None:
        return None
    started = time.monotonic()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    want_rng = latest.manifest.world_size == ctx.world_size
    rng_slot = {rng_key(ctx.rank): capture_rng(ctx.device)}
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    if want_rng:
        state["rng"] = rng_slot
    try:
        result = ckpt.load(state, root, missing_ok=True, on_event=on_event)
    except ckpt.StateMismatchError as exc:
        if not want_rng:
            raise CheckpointShapeError(
                f"checkpoint under {root} does not match this model: {exc}"
            ) from exc
        # A fallback may have landed on a checkpoint of another world size (no such RNG key).
        logger.warning("rank %d: retrying load without RNG state: %s", ctx.rank, exc)
        state.pop("rng")
        want_rng = False
        try:
            result = ckpt.load(state, root, missing_ok=True, on_event=on_event)
        except ckpt.StateMismatchError as exc2:
            raise CheckpointShapeError(
                f"checkpoint under {root} does not match this model: {exc2}"
            ) from exc2
    if result is None:
        return None
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    meta = result.metadata
    progress.step = int(meta["step"])
    progress.cursor = int(meta["data_cursor"])
    progress.world_sizes = [int(w) for w in meta.get("world_sizes", [])]
    old_world = int(result.manifest.world_size)
    rng_restored = want_rng and old_world == ctx.world_size
    if rng_restored:
        restore_rng(rng_slot[rng_key(ctx.rank)], ctx.device)
    else:
        reseed_process(seed, progress.step, ctx.rank)
    return ResumeInfo(
        step=progress.step,
        url=result.url,
        old_world_size=old_world,
        new_world_size=ctx.world_size,
        rng_restored=rng_restored,
        bytes_read=int(getattr(result, "bytes_read", 0) or 0),
        duration_s=float(getattr(result, "duration_s", time.monotonic() - started) or 0.0),
    )


CKPT_EVENT_NAMES = {
    "ckpt_saved": "checkpoint_saved",
    "ckpt_loaded": "checkpoint_loaded",
    "ckpt_fallback": "fallback",
}
"""How ``ckpt`` events are named in events.jsonl."""


class Checkpointer:
    """Saves and resumes one run's state under one root; every rank holds one.

    Wraps the collectives above with what the loop needs: event recording, the
    ``ckpt-storage`` fault seam, and the duration of the last save (the preemption
    handler uses it to decide whether an emergency save fits in the grace period).
    """

    def __init__(
        self,
        root: str,
        ctx: DistContext,
        *,
        seed: int,
        extra_metadata: dict[str, Any],
        record_event: Callable[..., None],
        async_save: bool = False,
    ) -> None:
        self.root = root
        self.ctx = ctx
        self.async_save = async_save
        self.seed = seed
        self.extra_metadata = extra_metadata
        self._record_event = record_event
        self.last_save_s: float | None = None

    def _sink(self, event: dict[str, Any]) -> None:
        fields = dict(event)
        raw_name = str(fields.pop("event", "ckpt_event"))
        step = int(fields.pop("step", 0) or 0)
        self._record_event(CKPT_EVENT_NAMES.get(raw_name, raw_name), step, **fields)

    def resume(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: TrainProgress
    ) -> ResumeInfo | None:
        """Check the root is usable, then load the newest committed checkpoint if any."""
        check_checkpoint_dir(self.root)
        return load_latest(
            self.root, model, optimizer, progress, self.ctx, seed=self.seed, on_event=self._sink
        )

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        progress: TrainProgress,
        *,
        fail_storage: bool = False,
        background: bool = False,
    ) -> str | None:
        """Save ``progress.step``; a failed save is logged and recorded, and returns None.

        With ``background`` (and ``checkpoint.async_save``), returns once the state is
        staged; an earlier background save that failed is reported here (as this call's
        failure: the earlier checkpoint was not committed).

        ``fail_storage`` (fault injection) makes this rank's shard writes fail, so the
        collective save fails on every rank and nothing is committed.
        """
        injected = (
            [storage_faults.StorageFault(phase="shard", kind="permanent", rank=self.ctx.rank)]
            if fail_storage
            else []
        )
        started = time.monotonic()
        try:
            with storage_faults.inject(*injected):
                url = save_checkpoint(
                    self.root, model, optimizer, progress, self.ctx,
                    extra_metadata=self.extra_metadata, on_event=self._sink,
                    async_save=background and self.async_save and not injected,
                )  # fmt: skip
        except (ckpt.SaveFailedError, ckpt.StorageError) as exc:
            logger.error(
                "rank %d step %d: checkpoint save failed, training continues: %s",
                self.ctx.rank, progress.step, exc,
            )  # fmt: skip
            self._record_event("checkpoint_failed", progress.step, error=str(exc))
            return None
        blocking_s = time.monotonic() - started
        if not (background and self.async_save):
            self.last_save_s = blocking_s  # preemption budgets use a full synchronous save
            if self.ctx.is_main:
                logger.info("rank 0 step %d: checkpoint committed at %s", progress.step, url)
        elif self.ctx.is_main:
            logger.info(
                "rank 0 step %d: checkpoint staged in %.3f s, committing in the background to %s",
                progress.step, blocking_s, url,
            )  # fmt: skip
        return url

    def drain(self) -> None:
        """Wait for a background save in flight (all ranks); record its failure if it failed."""
        try:
            ckpt.wait_pending()
        except (ckpt.SaveFailedError, ckpt.StorageError) as exc:
            logger.error("rank %d: background checkpoint save failed: %s", self.ctx.rank, exc)
            self._record_event("checkpoint_failed", 0, error=str(exc))
