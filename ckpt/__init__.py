"""ckpt: committed, verifiable, resharding checkpoints through fsspec.

Collective over the default process group when one is initialized, plain
single-process otherwise::

    url = ckpt.save(state, "gs://bucket/run1", step=100, metadata={"tokens": 1e9})
    result = ckpt.load(state, "gs://bucket/run1")   # newest committed, any world size
    result.step, result.url, result.metadata

Asynchronous save (returns once the state is staged in host memory)::

    pending = ckpt.save(state, root, step=200, async_save=True)   # ckpt.PendingSave
    ...                                  # train on; errors surface at the next save
    ckpt.close()                         # at exit, before destroy_process_group

Layout, manifest and commit rules: see DESIGN.md. ``python -m ckpt --help`` for the CLI.
"""

from __future__ import annotations

from ckpt.async_save import PendingSave, close, wait_pending
from ckpt.commit import save
from ckpt.discovery import CheckpointInfo, find_latest_committed, list_checkpoints
from ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FencedError,
    NoLoadableCheckpointError,
    SaveFailedError,
    StateMismatchError,
    StorageError,
    StoragePermanentError,
    StorageTimeoutError,
)
from ckpt.manifest import Attempt, CompleteMarker, Manifest
from ckpt.restore import LoadResult, SkippedCheckpoint, load
from ckpt.retention import RetentionPlan, RetentionPolicy, apply_retention, plan_retention
from ckpt.storage import Storage, StorageOptions
from ckpt.verify import VerifyReport, verify_dir

__all__ = [
    "Attempt",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CompleteMarker",
    "CorruptCheckpointError",
    "FencedError",
    "LoadResult",
    "Manifest",
    "NoLoadableCheckpointError",
    "PendingSave",
    "RetentionPlan",
    "RetentionPolicy",
    "SaveFailedError",
    "SkippedCheckpoint",
    "StateMismatchError",
    "Storage",
    "StorageError",
    "StorageOptions",
    "StoragePermanentError",
    "StorageTimeoutError",
    "VerifyReport",
    "apply_retention",
    "close",
    "find_latest_committed",
    "list_checkpoints",
    "load",
    "plan_retention",
    "save",
    "verify_dir",
    "wait_pending",
]
