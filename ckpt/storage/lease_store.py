"""Where a root's owner lease record lives, with a compare-and-swap (:mod:`ckpt.lifecycle.lease`).

One store per kind of backend, behind :class:`LeaseStore`; :func:`store_for` picks it:

- :class:`LocalLeaseStore` (a local or mounted filesystem, NFS and gcsfuse included):
  records ``OWNER.<generation>``; a write publishes a complete temporary file under the next
  generation's name with ``link(2)``, which fails when the name exists (NFS too), so of two
  writers from one generation exactly one wins; the highest generation is the record;
  older ones are removed by the winner. Without hard links (gcsfuse) the name is created
  with ``O_EXCL`` instead.
- :class:`GcsLeaseStore` (``gs://``): one object ``OWNER`` written by a multipart upload
  with ``ifGenerationMatch`` (0: only if absent), removed with the same precondition.
- :class:`S3LeaseStore` (``s3://``): one object ``OWNER`` written with S3's conditional
  writes (``If-None-Match: *`` when absent, ``If-Match`` its ETag), removed with
  ``If-Match``.
- :class:`FsspecLeaseStore` (anything else, ``memory://``): one object, checked then
  written under a process lock (``memory://`` lives in one process).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import uuid
from typing import Any, Protocol

from ckpt.errors import ObjectNotFoundError, RootLeaseError, StorageError
from ckpt.format.layout import LEASE_NAME, LEASE_RECORD_RE, LEASE_TMP_PREFIX
from ckpt.format.manifest import MAX_MARKER_BYTES
from ckpt.storage import Storage
from ckpt.storage.gcs_parts import GcsHttpError
from ckpt.storage.local import fsync_dir


class LeaseConflict(Exception):
    """The record changed between our read and our write (a compare-and-swap lost)."""


class LeaseStore(Protocol):
    """The record of one root with a compare-and-swap; ``version`` is opaque."""

    def read(self) -> tuple[bytes | None, Any]:
        """The record's bytes (None: there is none) and its version."""
        ...

    def write(self, data: bytes, version: Any) -> Any:
        """Write if the record is still at ``version``; the new version, or :class:`LeaseConflict`."""
        ...

    def delete(self, version: Any) -> None:
        """Remove the record if it is still at ``version`` (else leave it)."""
        ...

    def root_identity(self) -> Any:
        """What identifies the root itself (local: device and inode), or None."""
        ...

    def prepare(self) -> None:
        """Make the root exist where the record needs it to (a local directory)."""
        ...


def _not_a_record(path: str, what: str) -> str:
    return (
        f"{path} is named like the root's owner lease record but is {what}: this library "
        "did not write it and will not read or remove it; remove it by hand, then relaunch"
    )


def _read_regular(path: str) -> bytes:
    """A local record's bytes (at most one past :data:`MAX_MARKER_BYTES`): it must be a
    regular file, opened without following a link or blocking (a FIFO named like a
    record would hang the reader), else :class:`~ckpt.errors.RootLeaseError` saying so."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RootLeaseError(_not_a_record(path, "a symbolic link")) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RootLeaseError(_not_a_record(path, "not a regular file (a FIFO, device or directory)"))
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(MAX_MARKER_BYTES + 1)
    finally:
        os.close(fd)


class LocalLeaseStore:
    """Records ``OWNER.<generation>`` in a local (or mounted) directory, made by ``link(2)``."""

    def __init__(self, storage: Storage) -> None:
        self.dir = storage.path()

    def _generations(self) -> list[tuple[int, str]]:
        """``(generation, name)`` of every record, newest first (names as they are: one
        made by hand may have more leading zeros than ours)."""
        return sorted(
            ((int(m.group(1)), n) for n in os.listdir(self.dir) if (m := LEASE_RECORD_RE.match(n))),
            reverse=True,
        )

    def read(self) -> tuple[bytes | None, Any]:
        for _ in range(5):  # a newer writer may delete the record we just listed
            generations = self._generations()
            if not generations:
                return None, 0
            generation, name = generations[0]
            try:
                return _read_regular(os.path.join(self.dir, name)), generation
            except FileNotFoundError:
                continue
        raise StorageError(f"{self.dir}: the lease record kept changing while read")

    def write(self, data: bytes, version: Any) -> Any:
        new = int(version) + 1
        final = os.path.join(self.dir, f"OWNER.{new:010d}")
        tmp = os.path.join(self.dir, f"{LEASE_TMP_PREFIX}{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, final)  # fails if the name exists: the compare-and-swap
            except FileExistsError:
                raise LeaseConflict() from None
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
                self._create_exclusive(final, data)  # no hard links (gcsfuse)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        for old, name in self._generations():
            if old < new:
                try:
                    os.unlink(os.path.join(self.dir, name))
                except FileNotFoundError:
                    pass
        fsync_dir(self.dir)
        return new

    def delete(self, version: Any) -> None:
        # a newer generation (someone else's) has another number: never removed here
        for generation, name in self._generations():
            if generation == int(version):
                try:
                    os.unlink(os.path.join(self.dir, name))
                except FileNotFoundError:
                    pass
        fsync_dir(self.dir)

    @staticmethod
    def _create_exclusive(path: str, data: bytes) -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise LeaseConflict() from None
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    def root_identity(self) -> Any:
        st = os.stat(self.dir)
        return st.st_dev, st.st_ino

    def prepare(self) -> None:
        os.makedirs(self.dir, exist_ok=True)  # a root is created once, at the start of its job


class GcsLeaseStore:
    """One object ``OWNER`` written with ``ifGenerationMatch``."""

    def __init__(self, storage: Storage) -> None:
        self.client = storage.backend.transfer.client  # the GCS backend's JSON API client
        self.bucket, _, self.name = storage.path(LEASE_NAME).strip("/").partition("/")

    def read(self) -> tuple[bytes | None, Any]:
        try:
            return self.client.get_with_generation(self.bucket, self.name, MAX_MARKER_BYTES)
        except FileNotFoundError:
            return None, 0

    def write(self, data: bytes, version: Any) -> Any:
        try:
            resource = self.client.upload_if_generation(self.bucket, self.name, data, int(version))
        except GcsHttpError as exc:
            if exc.code == 412:
                raise LeaseConflict() from None
            raise
        return int(resource.get("generation", 0))

    def delete(self, version: Any) -> None:
        self.client.delete_if_generation(self.bucket, self.name, int(version))

    def root_identity(self) -> Any:
        return None

    def prepare(self) -> None:
        pass


class S3LeaseStore:
    """One object ``OWNER`` written with ``If-None-Match: *`` (absent) or ``If-Match: ETag``
    (S3's conditional writes), removed with ``If-Match``; the version is the ETag."""

    def __init__(self, storage: Storage) -> None:
        self.client = storage.backend.transfer.client.client  # the S3 backend's botocore
        self.bucket, _, self.key = storage.path(LEASE_NAME).strip("/").partition("/")
        self.url = storage.url(LEASE_NAME)

    def read(self) -> tuple[bytes | None, Any]:
        from ckpt.storage.s3 import translated

        try:
            with translated(self.url):
                answer = self.client.get_object(Bucket=self.bucket, Key=self.key)
                return answer["Body"].read(MAX_MARKER_BYTES + 1), answer["ETag"]
        except FileNotFoundError:
            return None, ""

    def write(self, data: bytes, version: Any) -> Any:
        from ckpt.storage.s3 import S3Error, translated

        condition = {"IfMatch": version} if version else {"IfNoneMatch": "*"}
        try:
            with translated(self.url):
                answer = self.client.put_object(
                    Bucket=self.bucket, Key=self.key, Body=data, **condition
                )
        except (S3Error, FileNotFoundError) as exc:
            # 412: the record moved on (or appeared); 409: a concurrent conditional write
            # won; 404: the record we read is gone.
            if isinstance(exc, FileNotFoundError) or exc.code in (409, 412):
                raise LeaseConflict() from None
            raise
        return answer["ETag"]

    def delete(self, version: Any) -> None:
        from ckpt.storage.s3 import S3Error, translated

        try:
            with translated(self.url):
                self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=version)
        except FileNotFoundError:
            pass
        except S3Error as exc:
            if exc.code != 412:  # another version: someone else's, left as it is
                raise

    def root_identity(self) -> Any:
        return None

    def prepare(self) -> None:
        pass


class FsspecLeaseStore:
    """One object ``OWNER`` checked, then written (other fsspec backends: not atomic
    between processes; ``memory://`` lives in one process, where a lock makes it so)."""

    _lock = threading.Lock()

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def read(self) -> tuple[bytes | None, Any]:
        try:
            raw = self.storage.read_bytes(LEASE_NAME, max_bytes=MAX_MARKER_BYTES)
        except ObjectNotFoundError:
            return None, b""
        return raw, raw

    def write(self, data: bytes, version: Any) -> Any:
        with self._lock:
            current, _ = self.read()
            if (current or b"") != version:
                raise LeaseConflict()
            self.storage.write_bytes(LEASE_NAME, data, phase="lease")
        return data

    def delete(self, version: Any) -> None:
        with self._lock:
            current, _ = self.read()
            if current == version:
                self.storage.remove(LEASE_NAME)

    def root_identity(self) -> Any:
        return None

    def prepare(self) -> None:
        pass


STORES: dict[str, type] = {"file": LocalLeaseStore, "gs": GcsLeaseStore, "s3": S3LeaseStore}
"""The lease store of a backend (by its scheme); any other: :class:`FsspecLeaseStore`."""


def store_for(storage: Storage) -> LeaseStore:
    """The store of ``storage``'s backend."""
    return STORES.get(storage.backend.scheme, FsspecLeaseStore)(storage)
