"""ckpt: committed, verifiable, resharding checkpoints through fsspec.

A training run uses one :class:`CheckpointManager` (models, optimizers, schedulers,
any ``Stateful`` and plain values in one dict; save policy, async saves, per-rank RNG,
resume on any world size)::

    manager = ckpt.CheckpointManager(root, {"model": model, "optim": opt, "sched": sched},
                                     options=ckpt.CheckpointOptions(every=50, async_save=True))
    start = manager.resume() or 0
    ...
    manager.maybe_save(step, final=step == max_steps)
    manager.close()

With ``memory_every=K`` the manager also keeps a snapshot every K steps in node memory
(tmpfs, replicated to another node) that ``resume()`` prefers when it is newer than the
newest durable checkpoint (docs/design.md, "Memory tier").

One-off saves and loads use the thin functions, collective over the default process
group when one is initialized, plain single-process otherwise::

    url = ckpt.save(state, "gs://bucket/run1", step=100, metadata={"tokens": 1e9})
    result = ckpt.load(state, "gs://bucket/run1")   # newest committed, any world size
    result.step, result.url, result.metadata

Asynchronous save (returns once the state is staged in host memory)::

    pending = ckpt.save(state, root, step=200, async_save=True)   # ckpt.PendingSave
    ...                                  # train on; errors surface at the next save
    ckpt.close()                         # at exit, before destroy_process_group

The model of a checkpoint as Hugging Face safetensors or one torch file (streamed, verified)::

    ckpt.export("gs://bucket/run1", "./my-model", dtype="bf16")   # python -m ckpt export

and back: a ``save_pretrained`` directory as the starting point of a sharded model::

    if manager.resume() is None:
        ckpt.load_pretrained(model, "./my-model")   # each rank reads its own shards

Layout, manifest and commit rules: docs/design.md. ``python -m ckpt --help`` for the CLI.
Only what a script needs is exported here: of the errors, the base
:class:`CheckpointError` and those a script catches. The parts behind it
(``ckpt.storage.Storage``, ``ckpt.format.manifest``,
``ckpt.root.retention.apply_retention``, every other error in ``ckpt.errors``)
are importable from their modules.
"""

from __future__ import annotations

from ckpt.errors import (
    CheckpointDirError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointShapeError,
    CorruptCheckpointError,
    NoLoadableCheckpointError,
    NonFiniteStateError,
    RootLeaseError,
    StateMismatchError,
    TooManySaveFailuresError,
)
from ckpt.interop.export import ExportResult, export
from ckpt.interop.pretrained import PretrainedLoad, load_pretrained
from ckpt.loading.restore import LoadResult, load
from ckpt.loading.verify import VerifyReport, verify_dir
from ckpt.manager import CheckpointManager, ResumeInfo
from ckpt.options import CheckpointOptions
from ckpt.root.catalog import CheckpointInfo, find_latest_committed, list_checkpoints
from ckpt.root.retention import RetentionPolicy
from ckpt.saving.async_save import PendingSave, close, wait_pending
from ckpt.saving.commit import save
from ckpt.state.per_rank import PerRank
from ckpt.storage import StorageOptions
from runcore.redact import install_log_redaction

install_log_redaction()  # root URLs' credentials and a root's control characters, in every log line

_MOVED_ERRORS = frozenset({
    "CheckpointExistsError",
    "DataPositionError",
    "ExportError",
    "FencedError",
    "RootChangedError",
    "SaveFailedError",
    "StateSpecError",
    "StorageError",
    "UnsupportedStateError",
})
"""Errors once exported here that a script rarely catches: they live in ``ckpt.errors``
(every one of them is a :class:`CheckpointError`)."""


def __getattr__(name: str) -> object:
    if name in _MOVED_ERRORS:
        import warnings

        from ckpt import errors

        warnings.warn(
            f"ckpt.{name} is ckpt.errors.{name} (ckpt exports the errors a script catches: "
            "CheckpointError and a few others)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(errors, name)
    raise AttributeError(f"module 'ckpt' has no attribute {name!r}")

__all__ = [
    "CheckpointDirError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointOptions",
    "CheckpointShapeError",
    "CorruptCheckpointError",
    "ExportResult",
    "LoadResult",
    "NoLoadableCheckpointError",
    "NonFiniteStateError",
    "PendingSave",
    "PerRank",
    "PretrainedLoad",
    "ResumeInfo",
    "RetentionPolicy",
    "RootLeaseError",
    "StateMismatchError",
    "StorageOptions",
    "TooManySaveFailuresError",
    "VerifyReport",
    "close",
    "export",
    "find_latest_committed",
    "list_checkpoints",
    "load",
    "load_pretrained",
    "save",
    "verify_dir",
    "wait_pending",
]
