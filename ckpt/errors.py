"""Exception types raised by :mod:`ckpt`.

Every message names the URL (and where it matters the step, file and rank) and
says what to do. Catch :class:`CheckpointError` to handle any of them
(:class:`StateSpecError`, a bad state dict given to the manager, is a ``TypeError``).
Every exception ``ckpt`` raises on purpose is defined here (the transport-level
``OSError`` stand-ins of fault injection and the gs:// client stay next to their code:
the storage layer turns them into :class:`StorageError`).

:class:`StateMismatchError` (and so :class:`CheckpointShapeError`), :class:`DataPositionError`
and :class:`StateSpecError` are deterministic (``runcore.errors.DeterministicError``): the
same script on the same checkpoint raises them again, so a restart cannot help.
:class:`CheckpointDirError` (and so :class:`RootLeaseError`) ends a job at once
(``runcore.errors.JobEndingError``): a retry must not adopt another job's root.
"""

from __future__ import annotations

from runcore.errors import DeterministicError, JobEndingError
from runcore.redact import redact


class CheckpointError(Exception):
    """Base class of every error raised by the checkpoint library. Its message never shows
    a URL's password or signed query (:func:`runcore.redact.redact`): it reaches logs,
    tracebacks and torchrun's error file."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class StorageError(CheckpointError):
    """A storage call failed (after retries, when the failure was transient)."""


class StoragePermanentError(StorageError):
    """A storage call failed in a way that retrying cannot fix (403, missing bucket...)."""


class StorageTimeoutError(StorageError, TimeoutError):
    """A storage call did not finish within its timeout."""


class WriteVerificationError(StorageError):
    """A written object's size or crc32c differs from what was streamed to it (retried)."""


class StorageFullError(StoragePermanentError):
    """No space left on the device (or quota) a checkpoint is written to; not retried."""


class ObjectNotFoundError(StoragePermanentError, FileNotFoundError):
    """The object or directory does not exist."""


class ObjectTooLargeError(StoragePermanentError):
    """An object is larger than what is read of it (a bounded read of untrusted input)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint failed verification: a file is missing, truncated or has a bad crc32c."""

    def __init__(self, message: str, *, url: str = "", path: str = "") -> None:
        super().__init__(message)
        self.url = url
        self.path = path


class UncommittedCheckpointError(CorruptCheckpointError):
    """A checkpoint listed as committed was no longer committed when read (pruned meanwhile)."""


class CheckpointUnreadableError(CheckpointError):
    """A committed checkpoint could not be checked or loaded for a reason outside its files.

    A storage outage, running out of memory, an unexpected error while decoding: resume
    falls back from it but never quarantines it (its files were not found damaged).
    """

    def __init__(self, message: str, *, url: str = "", path: str = "") -> None:
        super().__init__(message)
        self.url = url
        self.path = path


class CheckpointNotFoundError(CheckpointError):
    """No committed checkpoint exists where one was required."""


class NoLoadableCheckpointError(CheckpointError):
    """Committed checkpoints exist, but every one failed verification or loading."""

    def __init__(self, message: str, reasons: list[tuple[int, str]]) -> None:
        super().__init__(message)
        self.reasons = reasons


class StateMismatchError(CheckpointError, DeterministicError):
    """The state to load does not match the checkpoint (missing key, other shape).

    Falling back to an older checkpoint cannot fix this, so load raises it at once.
    """


class StateApplyError(StateMismatchError):
    """A loaded checkpoint's values could not be put into the objects: a
    ``load_state_dict`` raised (a value of the wrong type or range, or code that changed).
    A resume then tries the older checkpoints: one that applies shows the newer ones
    damaged (they are quarantined); none that does is this error, at once."""

    def __init__(self, message: str, *, key: str = "") -> None:
        super().__init__(message)
        self.key = key


class CheckpointExistsError(CheckpointError):
    """A committed checkpoint already exists at this step; committed checkpoints are immutable."""


class FencedError(CheckpointError):
    """A writer of an older attempt tried to commit over a newer attempt's checkpoint."""


class SaveFailedError(CheckpointError):
    """A collective save failed on at least one rank; nothing was committed."""


class TooManySaveFailuresError(SaveFailedError):
    """Saves failed ``max_failures`` times in a row, or the final save failed: the job stops.

    Training on without a durable checkpoint would lose every step since the last one.
    """


class CheckpointDirError(CheckpointError, JobEndingError):
    """The checkpoint root cannot be created, listed or reached (bad URL, permissions, bucket).

    Ends the job at its first occurrence under ``elastic.RunGuard``: a restart finds the
    same root (and for :class:`RootLeaseError`, would adopt another job's root once it
    ends)."""


class NonFiniteStateError(SaveFailedError):
    """A save found NaN or infinite values in floating tensors: it was not committed.

    A diverged state must never become the newest checkpoint (retention would then delete
    the last sound ones). ``keys`` maps each tensor's key to the ranks that held it.
    """

    def __init__(self, message: str, keys: dict[str, list[int]] | None = None) -> None:
        super().__init__(message)
        self.keys = dict(keys or {})


class RootLeaseError(CheckpointDirError):
    """Another job holds the root's owner lease: refused before any training (``ckpt.root.lease``)."""


class RecordConflict(Exception):
    """A conditional write or delete of a record lost: the record changed since it was
    read (:class:`ckpt.storage.base.ConditionalRecord`); the caller reads it again."""


class RootChangedError(SaveFailedError):
    """The root is no longer the one this job owns (deleted, replaced, unmounted, or its
    lease taken over): a save refuses to write there (``ckpt.root.lease``)."""


class CheckpointShapeError(StateMismatchError):
    """The newest checkpoint was written for objects of other shapes (another model)."""


class DataPositionError(CheckpointError, DeterministicError):
    """A save where training steps advanced but the data position (sampler cursor) did not."""


class ExportError(CheckpointError):
    """The export cannot be done as asked (bad input, existing output, wrong checkpoint)."""


class StockImportError(CheckpointError):
    """A stock DCP checkpoint that ``python -m ckpt import`` cannot bring in as it is (not
    one, no step, or items that are damaged or forged)."""


class StateSpecError(TypeError, DeterministicError):
    """A value in the manager's state dict cannot be checkpointed as given (a ``TypeError``)."""


class UnsupportedStateError(StateSpecError):
    """A value in a state to save could not be loaded back by a resume (a numpy object, an
    arbitrary class): refused at save, before anything is written (a ``TypeError``)."""


class SnapshotError(CheckpointError):
    """A memory snapshot was not committed (training goes on; the previous one stays)."""
