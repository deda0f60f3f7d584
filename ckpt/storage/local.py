"""The local filesystem backend: plain paths and ``file://``.

What a local disk gives that object stores do not, and what it needs:

- Durability: each file is fsynced before close, and a directory after new entries
  (:meth:`LocalBackend.sync_dir`), unless ``StorageOptions.fsync`` is off.
- Writes in pieces with early writeback (:class:`LocalSink`).
- A full disk is a :class:`~ckpt.errors.StorageFullError` saying how much is free,
  with the partial file removed (:func:`is_disk_full`).
- Links: listings come from ``lstat``; a symbolic link is reported as
  :data:`~ckpt.storage.base.LINK` and never followed (it may point outside the root),
  anything not a file or directory as :data:`~ckpt.storage.base.OTHER`.
- A move is one ``rename`` (atomic).
- The owner lease's record: generations made by ``link(2)`` (:class:`LocalRecord`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import stat
import sys
import uuid
from collections.abc import Callable
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from ckpt.errors import RecordConflict, RootLeaseError, StorageError, StorageFullError
from ckpt.format.checksum import ChecksummingWriter
from ckpt.format.manifest import MAX_MARKER_BYTES
from ckpt.storage.base import DIR, FILE, LINK, OTHER, Calls, Produce
from ckpt.storage.fsspec_generic import FsspecBackend

WRITE_BEHIND_BYTES = 16 << 20
"""Local writes ask the kernel to start writing back every this many bytes (Linux)."""
WRITE_PIECE_BYTES = 1 << 20
"""Local writes pass big buffers to the file in slices of this size."""

_DISK_FULL_ERRNO = frozenset({errno.ENOSPC, errno.EDQUOT})
_TORCH_WRITE_FAILED = "inline_container"
"""``torch.save`` into a full file raises ``RuntimeError: [enforce fail at
inline_container.cc:NNN] . unexpected pos ...``: the ENOSPC is only its context."""


def is_disk_full(exc: BaseException, path: str | None = None) -> bool:
    """Whether ``exc`` (or an error it was raised from) means the disk or quota is full.

    ENOSPC/EDQUOT anywhere in the chain; or torch's zip writer failing
    (``inline_container``) while the filesystem of ``path`` has less than one write
    piece free, for when the OSError itself was swallowed.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DISK_FULL_ERRNO:
            return True
        current = current.__cause__ or current.__context__
    if path is None or not isinstance(exc, RuntimeError) or _TORCH_WRITE_FAILED not in str(exc):
        return False
    try:
        return shutil.disk_usage(os.path.dirname(path) or ".").free < WRITE_PIECE_BYTES
    except OSError:
        return False


class LocalBackend(FsspecBackend):
    """A :class:`~ckpt.storage.base.Backend` for a local directory tree."""

    def __init__(self, fs: LocalFileSystem, options: Any) -> None:
        super().__init__(fs, options)
        self.scheme = "file"
        self.has_dirs = True

    def url(self, path: str) -> str:
        return path

    def read_pipeline(self) -> tuple[int | None, int]:
        # The reader sizes local spans to what it reads (about 8 spans of 4-64 MB), so
        # reading overlaps checking even for one small shard.
        return None, 1

    # -- writes -------------------------------------------------------------------------

    def write(self, path: str, produce: Produce, calls: Calls, *, phase: str) -> tuple[int, str]:
        fsync = self.options.fsync

        def write_once() -> tuple[int, str]:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with self.fs.open(path, "wb") as raw:
                    sink = LocalSink(calls.stream(raw), raw, write_behind=fsync)
                    stream = ChecksummingWriter(sink)
                    produce(stream)
                    raw.flush()
                    if fsync:
                        _fsync(raw)
            except Exception as exc:
                if is_disk_full(exc, path):
                    raise self._disk_full(path, exc) from exc
                raise
            self.check_written(path, stream.size, stream.crc32c)
            return stream.size, stream.crc32c

        return calls.call(f"write {path}", phase, write_once)

    def _disk_full(self, path: str, exc: BaseException) -> StorageFullError:
        """The partial file removed (its space comes back), and the error that says why."""
        try:
            os.remove(path)
        except OSError:
            pass
        try:
            usage = shutil.disk_usage(os.path.dirname(path))
            space = f"{usage.free} of {usage.total} bytes free there now"
        except OSError:
            space = "free space unknown"
        return StorageFullError(
            f"no space left on device under {os.path.dirname(path)}: writing {path} failed "
            f"({type(exc).__name__}: {exc}; {space}). Free space on that filesystem, keep "
            "fewer checkpoints, or use a root with room for at least two checkpoints."
        )

    def sync_dir(self, path: str) -> None:
        if self.options.fsync:
            fsync_dir(path)

    # -- listings (lstat: links never followed) ---------------------------------------------

    def list_dir(self, path: str) -> list[tuple[str, str]]:
        """The type comes from the directory (``d_type``), not a stat per entry as
        fsspec's ``ls(detail=True)`` does, so a root of 1,000 checkpoints lists as fast as
        one of 10 (bench ``curves``)."""
        try:
            with os.scandir(path) as it:
                return [(entry.name, _entry_kind(entry)) for entry in it]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list_files(self, path: str) -> dict[str, dict[str, Any]]:
        path = path.rstrip("/")
        out: dict[str, dict[str, Any]] = {}
        pending = [""]
        while pending:
            rel = pending.pop()
            try:
                with os.scandir(os.path.join(path, rel) if rel else path) as it:
                    entries = list(it)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                name = f"{rel}/{entry.name}" if rel else entry.name
                kind = _kind(st.st_mode)
                if kind == DIR:
                    pending.append(name)
                    continue
                out[name] = {"name": os.path.join(path, name), "size": st.st_size, "type": kind}
        return out

    def kind(self, path: str) -> str | None:
        try:
            return _kind(os.lstat(path).st_mode)
        except OSError:
            return None

    def check_reachable(self, path: str, calls: Calls) -> str | None:
        parent = path
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent.rstrip("/"))
        if parent and not os.path.isdir(parent):
            return (
                f"{parent} is a file, so the checkpoint root cannot be created there; "
                "choose another directory"
            )
        return None

    def conditional_record(self, path: str) -> LocalRecord:
        return LocalRecord(path)

    def move_tree(self, src: str, dst: str, calls: Calls) -> None:
        calls.call(f"rename {src} -> {dst}", "any", lambda: os.rename(src, dst))


def fsync_dir(path: str) -> None:
    """fsync a directory so that new entries in it survive a power loss (best effort: a
    filesystem that cannot is left as it is)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return DIR
    if stat.S_ISREG(mode):
        return FILE
    return LINK if stat.S_ISLNK(mode) else OTHER


def _entry_kind(entry: os.DirEntry[str]) -> str:
    """What a directory entry is, from the directory itself (``d_type``; a stat only where
    the filesystem does not say), never following a link."""
    if entry.is_symlink():
        return LINK
    if entry.is_dir(follow_symlinks=False):
        return DIR
    return FILE if entry.is_file(follow_symlinks=False) else OTHER


def _load_sync_file_range() -> Callable[[int, int, int], int] | None:
    """``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)`` from libc, or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    write_flag = 2  # SYNC_FILE_RANGE_WRITE: start writeback, do not wait for it
    return lambda fd, offset, nbytes: fn(fd, offset, nbytes, write_flag)


_sync_file_range = _load_sync_file_range()


class LocalSink:
    """How shard bytes go to a local file: in pieces, with early writeback.

    - Pieces: one ``write`` of a large tensor (tens of MB) at once now and then takes
      several times its usual time, which the same bytes written 1 MiB at a time do
      not, so big buffers are passed on in ``WRITE_PIECE_BYTES`` slices (no copy).
    - Writeback: without it every byte of a shard sits dirty in the page cache until
      the final ``fsync``, which then waits for all of it (write, then flush, in
      series). Asking the kernel to start writing back each ``WRITE_BEHIND_BYTES``
      range right away (Linux ``sync_file_range`` with ``SYNC_FILE_RANGE_WRITE``,
      which does not wait) overlaps the disk with the serialization of the next
      items, so the closing ``fsync`` (still called, and still what makes the file
      durable) finds little left to do.
    """

    def __init__(self, sink: Any, raw: Any, *, write_behind: bool) -> None:
        self._sink = sink
        self._raw = raw
        self._fd = _fileno(raw) if write_behind and _sync_file_range is not None else None
        self._started = 0  # bytes whose writeback was requested
        self._written = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        for offset in range(0, n, WRITE_PIECE_BYTES):
            self._sink.write(view[offset : offset + WRITE_PIECE_BYTES])
        self._written += n
        if self._fd is not None and self._written - self._started >= WRITE_BEHIND_BYTES:
            self._raw.flush()  # buffered bytes must reach the file before writeback
            assert _sync_file_range is not None
            if _sync_file_range(self._fd, self._started, self._written - self._started) == 0:
                self._started = self._written
        return n

    def flush(self) -> None:
        self._sink.flush()


def _fileno(handle: Any) -> int | None:
    for obj in (handle, getattr(handle, "f", None)):
        fileno = getattr(obj, "fileno", None)
        if fileno is None:
            continue
        try:
            return int(fileno())
        except Exception:  # io.UnsupportedOperation and friends
            continue
    return None


def _fsync(handle: Any) -> None:
    for obj in (handle, getattr(handle, "f", None)):
        fileno = getattr(obj, "fileno", None)
        if fileno is None:
            continue
        try:
            os.fsync(fileno())
            return
        except (OSError, ValueError, AttributeError, NotImplementedError):
            continue
        except Exception:  # io.UnsupportedOperation and friends
            continue


# -- the owner lease's record ---------------------------------------------------------


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
            raise RootLeaseError(
                _not_a_record(path, "not a regular file (a FIFO, device or directory)")
            )
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(MAX_MARKER_BYTES + 1)
    finally:
        os.close(fd)


class LocalRecord:
    """A :class:`~ckpt.storage.base.ConditionalRecord` on a local (or mounted) filesystem,
    NFS and gcsfuse included: generations ``NAME.<generation>`` beside each other. A write
    publishes a complete temporary file under the next generation's name with ``link(2)``,
    which fails when the name exists (NFS too), so of two writers from one generation
    exactly one wins; the highest generation is the record; older ones are removed by the
    winner. Without hard links (gcsfuse) the name is created with ``O_EXCL`` instead."""

    def __init__(self, path: str) -> None:
        self.dir, self.name = os.path.split(path)
        self._generation_re = re.compile(rf"^{re.escape(self.name)}\.(\d{{10,40}})$")
        self._tmp_prefix = f".{self.name}.tmp-"

    def _generations(self) -> list[tuple[int, str]]:
        """``(generation, name)`` of every record, newest first (names as they are: one
        made by hand may have more leading zeros than ours)."""
        return sorted(
            (
                (int(m.group(1)), n)
                for n in os.listdir(self.dir)
                if (m := self._generation_re.match(n))
            ),
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
        raise StorageError(f"{self.dir}: the record {self.name} kept changing while read")

    def write(self, data: bytes, version: Any) -> Any:
        new = int(version) + 1
        final = os.path.join(self.dir, f"{self.name}.{new:010d}")
        tmp = os.path.join(self.dir, f"{self._tmp_prefix}{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, final)  # fails if the name exists: the compare-and-swap
            except FileExistsError:
                raise RecordConflict() from None
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
            raise RecordConflict() from None
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    def root_identity(self) -> Any:
        st = os.stat(self.dir)
        return st.st_dev, st.st_ino

    def prepare(self) -> None:
        os.makedirs(self.dir, exist_ok=True)  # a root is created once, at the start of its job
