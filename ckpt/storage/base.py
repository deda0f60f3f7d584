"""The storage backend interface: what :class:`~ckpt.storage.Storage` asks of a backend.

A backend moves bytes for one kind of URL (local files, an fsspec filesystem, GCS,
S3). :class:`~ckpt.storage.Storage` holds what every backend shares - the root and
its keys, per-call timeouts, retries with backoff, fault injection, the error
taxonomy - and asks the backend only for the requests themselves.

Two kinds of method:

- **One request** (``read``, ``info``, ``list_dir``, ``list_files``, ``remove``,
  ``remove_tree``): one attempt, no retry inside. Storage times, retries and injects
  faults around each call.
- **Many requests** (``write``, ``read_range``, ``read_into``, ``move_tree``,
  ``check_reachable``): the
  backend may cut the work into several requests (parallel parts, one copy per object)
  and runs each through ``calls.call(what, phase, fn)`` (:class:`Calls`), so that a
  failed part is retried alone, under the same policy.

Paths are the backend's own (``bucket/prefix/key``, an absolute local path), as
returned by its ``open``; Storage joins keys onto the root path. Errors follow the
taxonomy :func:`ckpt.storage.is_transient` reads: ``FileNotFoundError`` for a missing
object or bucket, ``PermissionError`` or an ``OSError`` with an HTTP ``code`` of 401/403
for refused credentials, an ``OSError`` with ``code`` 408/429/5xx, ``TimeoutError`` or
``ConnectionError`` for what a retry may cure. A backend translates its client's own
exceptions into these (or raises :mod:`ckpt.errors` types itself).

One optional method, ``conditional_record(path)``, gives what the root's owner lease
(:mod:`ckpt.root.lease`) needs: one small record with a compare-and-swap
(:class:`ConditionalRecord`). A backend that has no atomic conditional write leaves it out
(or returns None): a job with a lease on such a root is refused with a clear error, never
given a lease two jobs could both take.

Which backend serves which URL scheme: :mod:`ckpt.storage.registry` (the registry).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ckpt.format.checksum import ChecksummingWriter

T = TypeVar("T")

DIR = "directory"
FILE = "file"
LINK = "link"
"""A symbolic link (local filesystems only): listed, never followed."""
OTHER = "other"
"""Neither a file, a directory nor a link (a socket, a device): never read."""

Produce = Callable[[ChecksummingWriter], None]
"""Writes an object's bytes into the stream it is given; repeatable (a retry calls it again)."""


class Calls(Protocol):
    """How a backend runs the requests of a many-request method (Storage provides it)."""

    def call(self, what: str, phase: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (one request) with the storage's timeout, retries and faults.

        ``what`` names the request and its URL for messages; ``phase`` is the save
        phase fault injection matches (``shard``, ``manifest``, ..., ``read``, ``any``).
        """
        ...

    def stream(self, raw: Any) -> Any:
        """The stream a write sends to: ``raw``, or what an armed ``truncate`` fault
        leaves of it (call inside ``call``)."""
        ...

    def body(self, buffers: list[memoryview | bytes]) -> list[memoryview | bytes]:
        """The buffers an upload sends: as given, or cut by an armed ``truncate`` fault
        (call inside ``call``)."""
        ...


class ConditionalRecord(Protocol):
    """One small record (the root's owner lease) with a compare-and-swap; ``version`` is
    opaque (a generation, an ETag). Writes and deletes are atomic between processes and
    hosts: of two writers from one version exactly one wins."""

    def read(self) -> tuple[bytes | None, Any]:
        """The record's bytes (None: there is none) and its version."""
        ...

    def write(self, data: bytes, version: Any) -> Any:
        """Write if the record is still at ``version`` (the version :meth:`read` gave for
        no record: only if there is none); the new version, or
        :class:`~ckpt.errors.RecordConflict`."""
        ...

    def delete(self, version: Any) -> None:
        """Remove the record if it is still at ``version`` (else leave it)."""
        ...

    def root_identity(self) -> Any:
        """What identifies the directory holding the record (local: device and inode), or
        None where there is no such thing (an object store)."""
        ...

    def prepare(self) -> None:
        """Make the directory the record lives in exist, where there are directories."""
        ...


class Backend(Protocol):
    """Bytes in and out of one kind of storage. One instance serves a root and every
    :meth:`~ckpt.storage.Storage.child` of it; it may be used from several threads."""

    scheme: str
    """The URL scheme messages use (``file``, ``memory``, ``gs``, ``s3``)."""

    def url(self, path: str) -> str:
        """The user-facing URL of a path of this backend."""
        ...

    # -- writes -------------------------------------------------------------------------

    def write(self, path: str, produce: Produce, calls: Calls, *, phase: str) -> tuple[int, str]:
        """Store what ``produce`` streams as the object ``path``, durable and checked
        (size, and crc32c where the backend reports one) when this returns
        ``(size, crc32c)``. Retries through ``calls`` may call ``produce`` again, or
        send again buffers it wrote (which the caller keeps alive until this returns)."""
        ...

    def sync_dir(self, path: str) -> None:
        """Make new entries of a directory durable (local filesystems); else nothing."""
        ...

    # -- reads --------------------------------------------------------------------------

    def read(self, path: str, start: int, end: int | None) -> Any:
        """Bytes ``[start, end)`` (``end=None``: to the end) in one request; may return
        fewer at the end of the object (Storage checks the length it needs)."""
        ...

    def read_range(self, path: str, start: int, end: int, calls: Calls, *, phase: str) -> Any:
        """Exactly bytes ``[start, end)`` (a short object is an error), in as many
        requests as the backend likes, without a prefetching cache."""
        ...

    def read_into(
        self, path: str, start: int, into: memoryview, calls: Calls, *, phase: str
    ) -> None:
        """Fill ``into`` with bytes ``[start, start + len(into))``, as :meth:`read_range`."""
        ...

    def read_pipeline(self) -> tuple[int | None, int]:
        """How a shard reader should read: ``(span bytes or None for its own, spans in
        flight)``."""
        ...

    def info(self, path: str) -> dict[str, Any]:
        """``size``, ``type`` and, where the store keeps one, ``crc32c`` (GCS encoding);
        ``FileNotFoundError`` when missing."""
        ...

    def list_dir(self, path: str) -> list[tuple[str, str]]:
        """``(name, kind)`` of the entries directly below ``path``; [] when missing."""
        ...

    def list_files(self, path: str) -> dict[str, dict[str, Any]]:
        """Every entry below ``path`` but directories, recursively, by path relative to
        it; links (where the backend has them) listed with type :data:`LINK`, not
        descended into."""
        ...

    def kind(self, path: str) -> str | None:
        """What ``path`` is without following a link (:data:`DIR`, :data:`FILE`,
        :data:`LINK`, :data:`OTHER`) on a backend that has links; None elsewhere or when
        missing."""
        ...

    def check_reachable(self, path: str, calls: Calls) -> str | None:
        """What makes the root ``path`` unusable (a missing bucket, a file where a
        directory should be), said for a user; None when it can be used (an empty or not
        yet created root can)."""
        ...

    # -- deletes and moves ----------------------------------------------------------------

    def remove(self, path: str) -> None:
        """Delete one object; a missing one is fine."""
        ...

    def remove_tree(self, path: str) -> None:
        """Delete ``path`` and everything below it; a missing one is fine."""
        ...

    def move_tree(self, src: str, dst: str, calls: Calls) -> None:
        """Move ``src`` and everything below it to ``dst`` (which must not exist)."""
        ...

    # -- optional -------------------------------------------------------------------------
    #
    # def conditional_record(self, path: str) -> ConditionalRecord | None:
    #     """The record at ``path`` with an atomic compare-and-swap; None (or no such
    #     method) where the store has none: the owner lease then refuses the root."""
