"""The generic backend: any fsspec filesystem (``memory://``, ``ckptmem://``, others).

Writes stream into ``fs.open(path, "wb")`` and are checked against ``fs.info`` (size,
and crc32c where the filesystem reports one); reads are ``cat_file`` with an explicit
range (no prefetching cache); a move copies every object, then deletes the source. Only
an in-memory filesystem has a conditional record (:class:`InProcessRecord`): the owner
lease refuses any other root served here.
The local, GCS and S3 backends build on it and replace what their store does better.
"""

from __future__ import annotations

import threading
from typing import Any

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

from ckpt.errors import ObjectNotFoundError, RecordConflict, WriteVerificationError
from ckpt.format.checksum import ChecksummingWriter
from ckpt.format.manifest import MAX_MARKER_BYTES
from ckpt.storage.base import DIR, FILE, Calls, Produce

GENERIC_READ_SPAN_BYTES = 64 << 20
"""The span of a shard read on a filesystem this backend knows nothing of."""


class FsspecBackend:
    """A :class:`~ckpt.storage.base.Backend` over one fsspec filesystem."""

    def __init__(self, fs: fsspec.AbstractFileSystem, options: Any) -> None:
        self.fs = fs
        """The fsspec filesystem (for tools and tests; Storage never uses it directly)."""
        self.options = options
        protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        self.scheme = protocols[0]
        # Object stores have no directories: a write creates its "parents", and a root
        # is reachable when its bucket is. An in-memory filesystem has real ones.
        self.has_dirs = "memory" in protocols

    @classmethod
    def open(cls, url: str, options: Any) -> tuple[FsspecBackend, str]:
        fs, path = fsspec.core.url_to_fs(url, **options.fs_kwargs)
        return cls(fs, options), path

    def url(self, path: str) -> str:
        return f"{self.scheme}://{path.lstrip('/')}"

    # -- writes -------------------------------------------------------------------------

    def write(self, path: str, produce: Produce, calls: Calls, *, phase: str) -> tuple[int, str]:
        def write_once() -> tuple[int, str]:
            if self.has_dirs:
                self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            with self.fs.open(path, "wb") as raw:
                stream = ChecksummingWriter(calls.stream(raw))
                produce(stream)
                raw.flush()
            self.check_written(path, stream.size, stream.crc32c)
            return stream.size, stream.crc32c

        return calls.call(f"write {self.url(path)}", phase, write_once)

    def check_written(self, path: str, size: int, crc32c: str) -> None:
        """The object as stored must have the size (and crc32c, where reported) streamed."""
        info = self.info(path)
        if int(info.get("size", -1)) != size:
            raise WriteVerificationError(
                f"{self.url(path)}: wrote {size} bytes but the object has {info.get('size')}"
            )
        remote_crc = info.get("crc32c")
        if remote_crc and remote_crc != crc32c:
            raise WriteVerificationError(
                f"{self.url(path)}: crc32c after upload is {remote_crc}, streamed {crc32c}"
            )

    def sync_dir(self, path: str) -> None:
        pass

    # -- reads --------------------------------------------------------------------------

    def read(self, path: str, start: int, end: int | None) -> Any:
        if start == 0 and end is None:
            return self.fs.cat_file(path)
        return self.fs.cat_file(path, start=start, end=end)

    def read_range(self, path: str, start: int, end: int, calls: Calls, *, phase: str) -> Any:
        def read_once() -> Any:
            data = self.read(path, start, end)
            if len(data) != end - start:
                raise WriteVerificationError(
                    f"{self.url(path)}: short read, asked bytes [{start}, {end}) got {len(data)}"
                )
            return data

        return calls.call(f"read {self.url(path)}[{start}:{end}]", phase, read_once)

    def read_into(
        self, path: str, start: int, into: memoryview, calls: Calls, *, phase: str
    ) -> None:
        into[:] = self.read_range(path, start, start + into.nbytes, calls, phase=phase)

    def read_pipeline(self) -> tuple[int | None, int]:
        # Spans of up to 64 MB, one ahead: a filesystem of unknown latency gets few,
        # large reads (the local backend leaves the span to the reader).
        return GENERIC_READ_SPAN_BYTES, 1

    def info(self, path: str) -> dict[str, Any]:
        self.fs.invalidate_cache(path)
        return self.fs.info(path)

    def list_dir(self, path: str) -> list[tuple[str, str]]:
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        out = []
        for entry in entries:
            if entry["name"].rstrip("/") == path.rstrip("/"):
                continue
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            out.append((name, DIR if entry.get("type") == "directory" else FILE))
        return out

    def list_files(self, path: str) -> dict[str, dict[str, Any]]:
        path = path.rstrip("/")
        self.fs.invalidate_cache(path)
        try:
            found = self.fs.find(path, detail=True)
        except FileNotFoundError:
            return {}
        return {name.removeprefix(path + "/"): meta for name, meta in found.items()}

    def kind(self, path: str) -> str | None:
        return None

    def check_reachable(self, path: str, calls: Calls) -> str | None:
        if self.has_dirs:
            return None
        bucket = path.strip("/").split("/", 1)[0]
        try:
            calls.call(f"stat bucket {bucket}", "read", lambda: self.info(bucket))
        except ObjectNotFoundError:
            return (
                f"the bucket {bucket!r} does not exist or is not visible with these "
                "credentials; create it, fix the URL, or check the account's permissions"
            )
        return None

    # -- deletes and moves ----------------------------------------------------------------

    def remove(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    def conditional_record(self, path: str) -> InProcessRecord | None:
        """An in-memory filesystem lives in this process, where a lock makes a check and a
        write one step; any other fsspec filesystem has no conditional write here: None
        (a job with an owner lease on it is refused)."""
        return InProcessRecord(self.fs, path) if isinstance(self.fs, MemoryFileSystem) else None

    def copy(self, src: str, dst: str) -> None:
        """Copy one object (one request; what :meth:`move_tree` does per object)."""
        self.fs.copy(src, dst)

    def move_tree(self, src: str, dst: str, calls: Calls) -> None:
        """Copy every object, then delete the source: an interrupted move leaves the source
        whole (the caller makes that safe) and possibly some copies at ``dst``, which a
        repeated move overwrites."""
        files = calls.call(f"list {self.url(src)}", "read", lambda: self.list_files(src))
        for name in sorted(files):
            source, target = f"{src}/{name}", f"{dst}/{name}"
            calls.call(
                f"copy {self.url(source)} -> {self.url(target)}",
                "any",
                lambda s=source, t=target: self.copy(s, t),
            )
        calls.call(f"delete {self.url(src)}/", "any", lambda: self.remove_tree(src))


class InProcessRecord:
    """A :class:`~ckpt.storage.base.ConditionalRecord` on a filesystem that lives in this
    process (``memory://``): checked, then written, under one lock; the version is the
    record's bytes."""

    _lock = threading.Lock()

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self.fs, self.path = fs, path

    def read(self) -> tuple[bytes | None, Any]:
        try:
            raw = bytes(self.fs.cat_file(self.path)[: MAX_MARKER_BYTES + 1])
        except FileNotFoundError:
            return None, b""
        return raw, raw

    def write(self, data: bytes, version: Any) -> Any:
        with self._lock:
            current, _ = self.read()
            if (current or b"") != version:
                raise RecordConflict()
            self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(self.path, data)
        return data

    def delete(self, version: Any) -> None:
        with self._lock:
            current, _ = self.read()
            if current == version:
                self.fs.rm_file(self.path)

    def root_identity(self) -> Any:
        return None

    def prepare(self) -> None:
        pass
