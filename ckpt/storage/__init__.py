"""Storage layer: every byte of a checkpoint goes through a :class:`Storage`, here.

A :class:`Storage` is rooted at a URL (local path, ``file://``, ``memory://``,
``gs://bucket/prefix``, ``s3://bucket/prefix``, any fsspec URL) and addresses objects by
a relative key. What differs between stores lives in a backend (:mod:`ckpt.storage.registry`,
chosen by the URL's scheme); what they share lives here: every request has a timeout;
transient failures (HTTP 408/429/5xx, timeouts, connection resets, a write whose size
or crc32c does not match what was streamed) are retried with exponential backoff and
jitter, bounded in attempts and total time; permanent ones (403, missing bucket or
object, bad credentials) fail at once with a message that names the URL; armed
storage faults (:mod:`ckpt.storage.faults`) act on the requests.

Writes stream through a :class:`~ckpt.format.checksum.ChecksummingWriter` and are checked
before they return: the object's size (and, where the store reports one, its crc32c)
must equal what was streamed. Local files are fsynced; GCS and S3 send large objects
as parallel parts (:mod:`ckpt.storage.parts`).

Environment (read when :meth:`StorageOptions.from_env` is called; explicit
arguments win over the environment, which wins over the defaults):

- ``CKPT_STORAGE_TIMEOUT_S``: timeout of one storage call (default 300)
- ``CKPT_STORAGE_RETRIES``: attempts per call, first one included (default 6)
- ``CKPT_STORAGE_RETRY_TOTAL_S``: give up retrying after this long (default 120)
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from ckpt import env as _env
from ckpt.errors import (
    ObjectNotFoundError,
    ObjectTooLargeError,
    StorageError,
    StoragePermanentError,
    StorageTimeoutError,
    WriteVerificationError,
)
from ckpt.format.checksum import crc32c_of_chunks
from ckpt.format.layout import join_url
from ckpt.storage import faults
from ckpt.storage.base import DIR, FILE, LINK, OTHER, Backend, ConditionalRecord, Produce
from ckpt.storage.registry import open_backend

logger = logging.getLogger(__name__)

ENV_TIMEOUT_S = _env.STORAGE_TIMEOUT_S
ENV_RETRIES = _env.STORAGE_RETRIES
ENV_RETRY_TOTAL_S = _env.STORAGE_RETRY_TOTAL_S

_TRANSIENT_HTTP = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_ERRNO = frozenset(
    {
        errno.EAGAIN,
        errno.EINTR,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EPIPE,
    }
)

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageOptions:
    """How storage calls are bounded and retried."""

    timeout_s: float = 300.0
    """Timeout of one storage call (one object write, read, list or delete)."""
    retry_attempts: int = 6
    """Attempts per call for transient errors, the first one included."""
    retry_total_s: float = 120.0
    """Stop retrying once this much time has passed since the first attempt."""
    backoff_initial_s: float = 0.2
    """Scale of the exponential backoff (jittered)."""
    backoff_max_s: float = 10.0
    """Longest wait between two attempts."""
    fsync: bool = True
    """fsync local files before close (durability)."""
    fs_kwargs: dict[str, Any] = field(default_factory=dict, repr=False)
    """Extra keyword arguments for the fsspec filesystem (e.g. ``token``, ``project``,
    ``endpoint_url``). Not in the repr: they may hold credentials (``key``, ``secret``)."""
    transfer: Any = None
    """Tuning of the root's backend, an object of its own options class (how objects are
    cut into parallel part uploads and ranged reads: e.g.
    :class:`~ckpt.storage.gcs_parts.GcsTransferOptions` for ``gs://``); ``None``: its defaults.
    Backends without tuning ignore it."""
    gcs: Any = None
    """For ``gs://`` roots, the same as ``transfer`` (which wins when both are set)."""
    read_once: bool | None = None
    """Loads on 2+ ranks: items every rank loads (replicated state: all of it under DDP)
    are read from storage by one rank each and broadcast to the others over the
    checkpoint group, each still checked against its crc32c on every rank
    (:mod:`ckpt.loading.read_once`). ``None``: on for object stores, where each rank's
    read is requests, egress and bandwidth; off for local and mounted paths, where the
    page cache serves every rank faster than a broadcast. ``True``/``False`` force it."""
    faults: faults.FaultRegistry | None = field(default=None, compare=False, repr=False)
    """Storage fault injection for these calls (``None``: the one-off functions' registry,
    ``ckpt.defaults``). Consulted only while it has a fault armed."""

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= _env.MAX_SECONDS:
            raise ValueError(f"timeout_s must be > 0 and finite, got {self.timeout_s}")
        if self.retry_attempts < 1:
            raise ValueError(f"retry_attempts must be >= 1, got {self.retry_attempts}")
        if not 0 <= self.retry_total_s <= _env.MAX_SECONDS:
            raise ValueError(f"retry_total_s must be >= 0 and finite, got {self.retry_total_s}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> StorageOptions:
        values: dict[str, Any] = {
            "timeout_s": _env.get_float(ENV_TIMEOUT_S, 300.0, positive=True, env=env),
            "retry_attempts": _env.get_int(ENV_RETRIES, 6, minimum=1, maximum=1000, env=env),
            "retry_total_s": _env.get_float(ENV_RETRY_TOTAL_S, 120.0, minimum=0.0, env=env),
        }
        values.update(overrides)
        return cls(**values)


@dataclass(frozen=True, slots=True)
class FileRecord:
    """A file as written: relative path (to the checkpoint directory), size, crc32c."""

    path: str
    size: int
    crc32c: str


def http_status(exc: BaseException) -> int | None:
    """The HTTP status carried by an exception (gcsfs HttpError, aiohttp, injected), if any."""
    for attr in ("code", "status"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the call that raised ``exc`` may succeed."""
    if isinstance(exc, StoragePermanentError | FileNotFoundError | PermissionError):
        return False
    verdict = getattr(exc, "retryable", None)
    if isinstance(verdict, bool):  # a backend's own verdict on its client's error
        return verdict
    if isinstance(
        exc, StorageTimeoutError | WriteVerificationError | TimeoutError | ConnectionError
    ):
        return True
    status = http_status(exc)
    if status is not None:
        return status in _TRANSIENT_HTTP
    module = type(exc).__module__ or ""
    if module.startswith("aiohttp") or type(exc).__name__ in ("ServerDisconnectedError",):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNO


def _run_with_timeout(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run ``fn`` in a daemon thread and give up waiting after ``timeout_s``.

    A call that does not return is abandoned (its daemon thread cannot block the
    process from exiting) and reported as :class:`StorageTimeoutError`.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"ckpt-io:{what[:40]}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise StorageTimeoutError(f"{what}: no answer within {timeout_s:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class CallPolicy:
    """What every storage request runs under: a timeout, retries of transient errors with
    backoff, the fault registry's planned failures, and errors turned into
    :mod:`ckpt.errors` types. Backends get it as their
    :class:`~ckpt.storage.base.Calls` for requests they make themselves (parts)."""

    def __init__(self, options: StorageOptions, registry: faults.FaultRegistry) -> None:
        self.options = options
        self.faults = registry

    def call(self, what: str, phase: str, fn: Callable[[], T]) -> T:
        """Run one storage request with timeout and retries (and injected faults, when armed)."""
        opts = self.options
        registry = self.faults

        def timed(call: Callable[[], T]) -> T:
            return _run_with_timeout(call, opts.timeout_s, what)

        def attempt() -> T:
            if not registry.armed:  # no fault configured: nothing else on the path
                return timed(fn)
            return registry.run(phase, what, fn, timed)

        def log_retry(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            logger.warning(
                "storage: %s failed (attempt %d/%d): %s: %s; retrying",
                what,
                state.attempt_number,
                opts.retry_attempts,
                type(exc).__name__,
                exc,
            )

        retrying = Retrying(
            stop=stop_after_attempt(opts.retry_attempts) | stop_after_delay(opts.retry_total_s),
            wait=wait_random_exponential(multiplier=opts.backoff_initial_s, max=opts.backoff_max_s),
            retry=retry_if_exception(is_transient),
            before_sleep=log_retry,
            reraise=True,
        )
        try:
            return retrying(attempt)
        except StorageError:
            raise
        except FileNotFoundError as exc:
            raise ObjectNotFoundError(f"{what}: not found ({exc})") from exc
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            if is_transient(exc):
                raise StorageError(
                    f"{what}: still failing after retries ({type(exc).__name__}: {exc})"
                ) from exc
            if not isinstance(exc, OSError) and http_status(exc) is None:
                raise  # a bug or a bad argument, not a storage condition
            raise StoragePermanentError(
                f"{what}: {type(exc).__name__}: {exc}. This is not retried: check that the "
                "bucket or directory exists and that the credentials allow access."
            ) from exc

    def stream(self, raw: Any) -> Any:
        """``raw``, or under an armed ``truncate`` fault a stream that drops halves."""
        return self.faults.sink(raw) if self.faults.armed else raw

    def body(self, buffers: list[memoryview | bytes]) -> list[memoryview | bytes]:
        """The buffers, or what an armed ``truncate`` fault leaves of them."""
        return self.faults.body(buffers) if self.faults.armed else buffers


class Storage:
    """Bounded, retried access to the objects under one root URL.

    Any rank may create one; instances hold no open files between calls. The bytes move
    through :attr:`backend` (:mod:`ckpt.storage.registry`); everything here is common to all.
    """

    def __init__(self, root_url: str, options: StorageOptions | None = None) -> None:
        if not isinstance(root_url, str) or not root_url:
            raise TypeError(f"checkpoint root must be a non-empty str URL, got {root_url!r}")
        self.root_url = root_url.rstrip("/") if root_url != "/" else root_url
        self.options = options or StorageOptions.from_env()
        try:
            backend, self.root_path = open_backend(self.root_url, self.options)
        except (ImportError, ValueError) as exc:
            raise StoragePermanentError(
                f"cannot open storage for {self.root_url!r}: {exc}. Check the URL (a local "
                "path, or scheme://...: ckpt.storage.registry.BACKENDS lists the stores, any other "
                "scheme goes through fsspec) and that the store's client library is installed."
            ) from exc
        self.backend: Backend = backend
        """What moves the bytes for this root's URL scheme (shared with children)."""
        self.faults = (
            self.options.faults if self.options.faults is not None else faults.default_registry()
        )
        """The fault registry of this storage's calls (installed from outside: the options)."""
        self.calls = CallPolicy(self.options, self.faults)
        """Timeouts, retries and faults around each request (shared with children)."""

    # -- addressing -------------------------------------------------------------------

    def url(self, key: str = "") -> str:
        """The user-facing URL of ``key`` (for messages and return values)."""
        return join_url(self.root_url, key)

    def path(self, key: str = "") -> str:
        """The backend's path of ``key``."""
        return join_url(self.root_path, key)

    def child(self, key: str) -> Storage:
        """A Storage rooted at ``key`` below this root, sharing options and backend."""
        sub = object.__new__(Storage)
        sub.root_url, sub.root_path, sub.options = self.url(key), self.path(key), self.options
        sub.backend, sub.faults, sub.calls = self.backend, self.faults, self.calls
        return sub

    def _call(self, what: str, phase: str, fn: Callable[[], T]) -> T:
        return self.calls.call(what, phase, fn)

    # -- writes -----------------------------------------------------------------------

    def write(self, key: str, produce: Produce, *, phase: str) -> FileRecord:
        """Stream an object produced by ``produce(stream)``; durable and size-checked on return.

        On a transient failure the whole object may be produced again, so ``produce``
        must be repeatable. On ``gs://`` and ``s3://`` it is produced once and the
        buffers it writes are sent without copies (:mod:`ckpt.storage.parts`): they
        must stay alive and unchanged until this returns (raw buffers: register their
        owner with ``stream.keep_alive(owner)`` where the stream has it).
        """
        size, crc32c = self.backend.write(self.path(key), produce, self.calls, phase=phase)
        return FileRecord(key, size, crc32c)

    def write_bytes(self, key: str, data: bytes, *, phase: str) -> FileRecord:
        """Write a small object in one piece (JSON, markers)."""
        return self.write(key, lambda stream: stream.write(data), phase=phase)

    def sync_dir(self, key: str = "") -> None:
        """Make new entries of a directory durable (fsync on a local root; else nothing)."""
        self.backend.sync_dir(self.path(key))

    # -- reads ------------------------------------------------------------------------

    def read_bytes(self, key: str, *, phase: str = "read", max_bytes: int | None = None) -> bytes:
        """Read a whole (small) object.

        ``max_bytes``: refuse (:class:`~ckpt.errors.ObjectTooLargeError`) an object larger
        than this without reading more than one byte past it: what a checkpoint says
        about its own files is untrusted input.
        """
        path = self.path(key)
        if max_bytes is None:
            return self._call(
                f"read {self.url(key)}", phase, lambda: self.backend.read(path, 0, None)
            )

        def read_bounded() -> bytes:
            if self.backend.scheme == "file":
                data = _read_local_bounded(path, max_bytes)
            else:
                data = self.backend.read(path, 0, max_bytes + 1)
                data = data if isinstance(data, bytes) else bytes(data)
            if len(data) > max_bytes:
                raise ObjectTooLargeError(
                    f"{self.url(key)} is larger than the {max_bytes} bytes expected of it"
                )
            return data

        return self._call(f"read {self.url(key)}", phase, read_bounded)

    def read_range(self, key: str, start: int, end: int, *, phase: str = "read") -> Any:
        """Read bytes ``[start, end)`` with explicit ranged requests (no prefetching cache).

        On ``gs://`` and ``s3://`` a large range is fetched as several ranged requests in
        parallel.
        """
        return self.backend.read_range(self.path(key), start, end, self.calls, phase=phase)

    def read_range_into(
        self, key: str, start: int, into: memoryview, *, phase: str = "read"
    ) -> None:
        """Read bytes ``[start, start + len(into))`` into ``into`` (a reused buffer).

        On ``gs://`` and ``s3://`` the download writes straight into it (parallel ranged
        requests); elsewhere this is :meth:`read_range` plus a copy.
        """
        self.backend.read_into(self.path(key), start, into, self.calls, phase=phase)

    def read_pipeline(self) -> tuple[int | None, int]:
        """How a shard reader should read this storage: ``(span bytes, spans in flight)``.

        Local files: the reader's own span size, one span ahead. Object stores: spans of
        one ranged request each, several in flight, into recycled buffers.
        """
        return self.backend.read_pipeline()

    def read_chunks(
        self, key: str, *, chunk_bytes: int = 16 << 20, phase: str = "read"
    ) -> Iterator[Any]:
        """Yield an object's bytes in order, one bounded ranged read per chunk."""
        size = self.size(key)
        for start in range(0, size, chunk_bytes):
            yield self.read_range(key, start, min(size, start + chunk_bytes), phase=phase)

    def info(self, key: str) -> dict[str, Any]:
        """Object metadata (``size``; ``crc32c`` where the backend reports one)."""
        path = self.path(key)
        return self._call(f"stat {self.url(key)}", "read", lambda: self.backend.info(path))

    def size(self, key: str) -> int:
        return int(self.info(key)["size"])

    def exists(self, key: str) -> bool:
        try:
            self.info(key)
        except ObjectNotFoundError:
            return False
        return True

    def list_dir(self, key: str = "") -> list[tuple[str, str]]:
        """Entries directly below ``key`` as ``(name, kind)``; empty if it does not exist.

        ``kind`` is :data:`DIR`, :data:`FILE`, or, on a local filesystem, :data:`LINK` for a
        symbolic link (never followed: what it points to may be outside the root) and
        :data:`OTHER` for anything else (a socket, a device).
        """
        path = self.path(key)
        return self._call(f"list {self.url(key)}", "read", lambda: self.backend.list_dir(path))

    def local_kind(self, key: str) -> str | None:
        """What ``key`` is on a local filesystem, from ``lstat`` (a link is :data:`LINK`, not
        what it points to); None on other backends or when it does not exist."""
        return self.backend.kind(self.path(key))

    def list_files(self, key: str = "") -> dict[str, dict[str, Any]]:
        """Every file below ``key`` (recursively) as ``{relative path: info dict}``.

        On a local filesystem symbolic links are listed, not followed: their info has
        ``"type": LINK`` (and anything not a regular file ``"type": OTHER``), so a caller
        can refuse them before reading or deleting through them.
        """
        path = self.path(key)
        return self._call(f"list {self.url(key)}", "read", lambda: self.backend.list_files(path))

    def conditional_record(self, key: str) -> ConditionalRecord | None:
        """The record ``key`` with an atomic compare-and-swap (what the owner lease keeps),
        or None where the backend has none (:class:`~ckpt.storage.base.ConditionalRecord`).
        Each of its methods is one request: the caller times and retries them."""
        make = getattr(self.backend, "conditional_record", None)
        return None if make is None else make(self.path(key))

    def check_reachable(self) -> None:
        """Fail clearly if the root cannot exist: a missing bucket, a file where a
        directory should be. An empty or not yet created root is fine (saves create it).

        Object stores report a missing bucket like an empty listing, so load calls
        this when it finds nothing: a typo in a bucket name must not look like a
        fresh run.
        """
        problem = self.backend.check_reachable(self.root_path, self.calls)
        if problem is not None:
            raise StoragePermanentError(f"{self.root_url}: {problem}")

    def move_tree(self, src: str, dst: str) -> None:
        """Move ``src`` and everything below it to ``dst`` (which must not exist).

        A local root renames (atomic); an object store copies every object, then deletes
        the source, so an interrupted move leaves the source whole (the caller makes that
        safe) and possibly some copies at ``dst``, which a repeated move overwrites.
        """
        self.backend.move_tree(self.path(src), self.path(dst), self.calls)

    # -- deletes ----------------------------------------------------------------------

    def remove(self, key: str) -> None:
        """Delete one object; a missing one is fine."""
        path = self.path(key)
        self._call(f"delete {self.url(key)}", "any", lambda: self.backend.remove(path))

    def remove_tree(self, key: str) -> None:
        """Delete ``key`` and everything below it; a missing one is fine."""
        path = self.path(key)
        self._call(f"delete {self.url(key)}/", "any", lambda: self.backend.remove_tree(path))


def crc32c_of_object(storage: Storage, key: str) -> tuple[int, str]:
    """Read an object in bounded chunks and return ``(size, crc32c)`` (deep verification)."""
    return crc32c_of_chunks(storage.read_chunks(key))


__all__ = [
    "DIR",
    "FILE",
    "LINK",
    "OTHER",
    "CallPolicy",
    "FileRecord",
    "Storage",
    "StorageOptions",
    "crc32c_of_object",
    "http_status",
    "is_transient",
]


def _read_local_bounded(path: str, max_bytes: int) -> bytes:
    """A local file's bytes, at most ``max_bytes + 1``, allocating no more than the file
    holds: a read of ``max_bytes + 1`` reserves that much however small the file is (a
    manifest limit of 256 MB on every read of a 2 KB manifest)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return f.read(min(size, max_bytes) + 1)
