"""The one place where :mod:`ckpt` runs collectives.

Save and load are sequences of local steps; this wrapper runs them so that an
exception on one rank never leaves the others waiting in a collective: errors
are gathered, the coordinator decides, the outcome is broadcast, and every rank
raises the same error.

Checkpoint collectives run on a separate gloo group (created once per default
process group, by all ranks, the first time a save or load runs) so they never
interleave with training collectives and work whatever the training backend is.
Its timeout bounds how long a rank waits for a dead peer:

- ``CKPT_COLLECTIVE_TIMEOUT_S``: timeout of the checkpoint group (default 600 s).

Without an initialized default process group everything runs locally (world 1).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from ckpt import env, errors
from ckpt.defaults import created, process_defaults

logger = logging.getLogger(__name__)

ENV_COLLECTIVE_TIMEOUT_S = env.COLLECTIVE_TIMEOUT_S
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0

T = TypeVar("T")


def new_checkpoint_group(
    timeout_s: float | None = None, *, setup_timeout_s: float | None = None
) -> Any:
    """A new gloo group over every rank for checkpoint collectives (collective call).

    ``timeout_s`` defaults to ``CKPT_COLLECTIVE_TIMEOUT_S`` (600 s): how long a rank
    waits in a checkpoint collective for a dead peer. ``setup_timeout_s`` (None: the
    same) bounds the creation itself, where every rank waits for the others to arrive:
    a caller that knows its job's bound for a dead peer passes it, and the group then
    gets ``timeout_s`` for its collectives. A ``CheckpointManager`` creates one for
    itself; the module-level ``ckpt.save``/``ckpt.load`` share a cached one.
    """
    if timeout_s is None:
        timeout_s = env.get_float(
            ENV_COLLECTIVE_TIMEOUT_S, DEFAULT_COLLECTIVE_TIMEOUT_S, positive=True
        )
    if setup_timeout_s is not None and not setup_timeout_s > 0:
        raise ValueError(f"setup_timeout_s must be > 0 seconds, got {setup_timeout_s!r}")
    setup_s = timeout_s if setup_timeout_s is None else min(setup_timeout_s, timeout_s)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=setup_s))
    if setup_s < timeout_s:
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)
    return group


def _checkpoint_group() -> Any:
    """The one-off functions' checkpoint group over the default group (``ckpt.defaults``)."""
    default = dist.distributed_c10d._get_default_group()
    return process_defaults().checkpoint_group(default, new_checkpoint_group)


def release_groups() -> None:
    """Forget the cached checkpoint group and the save plans kept for the group's ranks
    (they hold its device meshes); call before ``destroy_process_group``.

    A reference to a destroyed gloo group that lives until interpreter teardown can
    abort the process there ("terminate called without an active exception").
    """
    defaults = created()
    if defaults is not None:
        defaults.release_groups()


class Collective:
    """Rank, world size and failure-safe collectives for one save or load."""

    def __init__(self, process_group: Any = None) -> None:
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = _checkpoint_group()
        self.group = process_group
        if self.group is None:
            self.rank, self.world_size = 0, 1
        else:
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)

    @property
    def distributed(self) -> bool:
        return self.group is not None

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (a plain list of one without a group)."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every rank."""
        if self.group is None:
            return obj
        box = [obj if self.is_coordinator else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def on_coordinator(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the coordinator only; every rank returns its value or raises its error."""
        outcome: tuple[str, Any]
        if self.is_coordinator:
            try:
                outcome = ("ok", fn())
            except Exception as exc:
                logger.debug("ckpt: %s failed on the coordinator", what, exc_info=True)
                outcome = ("error", _describe(exc))
        else:
            outcome = ("ok", None)
        outcome = self.broadcast(outcome)
        if outcome[0] == "error":
            raise _rebuild(outcome[1], what, rank=0)
        return outcome[1]

    def on_every_rank(self, what: str, fn: Callable[[], T]) -> list[T]:
        """Run ``fn`` on every rank; return all values, or raise the first rank's error everywhere."""
        try:
            outcome: tuple[str, Any] = ("ok", fn())
        except Exception as exc:
            logger.debug("ckpt: %s failed on rank %d", what, self.rank, exc_info=True)
            outcome = ("error", _describe(exc))
        gathered = self.all_gather(outcome)
        for rank, (status, value) in enumerate(gathered):
            if status == "error":
                raise _rebuild(value, what, rank=rank)
        return [value for _, value in gathered]


def _describe(exc: BaseException) -> dict[str, str]:
    desc = {"type": type(exc).__name__, "message": str(exc)}
    for attr in ("url", "path"):  # CorruptCheckpointError: which file failed, for fallback events
        if isinstance(getattr(exc, attr, None), str):
            desc[attr] = getattr(exc, attr)
    return desc


def _rebuild(desc: dict[str, str], what: str, *, rank: int) -> errors.CheckpointError:
    """Re-create an error reported by another rank as the same ckpt error type where possible."""
    cls = getattr(errors, desc["type"], None)
    message = desc["message"]
    if isinstance(cls, type) and issubclass(cls, errors.CheckpointError):
        try:
            rebuilt = cls(message) if cls not in _TWO_ARG else cls(message, [])
        except TypeError:
            pass
        else:
            for attr in ("url", "path"):
                if attr in desc:
                    setattr(rebuilt, attr, desc[attr])
            return rebuilt
    return errors.CheckpointError(f"{what} failed on rank {rank}: {desc['type']}: {message}")


_TWO_ARG = (errors.NoLoadableCheckpointError,)


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Silence DCP's warning that it assumes one process: without a group, that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        yield
