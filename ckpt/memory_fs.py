"""``ckptmem://``: a per-process, read-only fsspec filesystem over memory-tier files.

A memory-tier resume (:mod:`ckpt.memory_restore`) hands the normal verified loader
(``ckpt.load``: manifest, ``.metadata``, every item's crc32c, resharding) a root whose
files are what this rank can reach without copying them first:

- a file on this node's tmpfs: a read-only ``mmap`` of it (a ranged read is a view of
  the page cache, no copy; the loader's checksum and its copy into the destination
  tensor read straight from it);
- a file from another node: only the byte ranges this rank's load plan reads, as they
  arrived over gloo (a read outside them fails, it never returns other bytes);
- small files (manifest.json, COMPLETE, ``.metadata``): bytes.

Ranged reads return ``memoryview`` objects (the loader takes any buffer); whole-file
reads return ``bytes``. The files live in a class-level registry under a key unique to
the restore, removed by :func:`release`.
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
from typing import Any, ClassVar

import fsspec
import torch
from fsspec import AbstractFileSystem

PROTOCOL = "ckptmem"


class _File:
    size: int

    def read(self, start: int, end: int) -> memoryview:
        raise NotImplementedError

    def close(self) -> None:
        pass


class BytesFile(_File):
    def __init__(self, data: bytes) -> None:
        self.data = bytes(data)
        self.size = len(self.data)

    def read(self, start: int, end: int) -> memoryview:
        return memoryview(self.data)[start:end]


class MappedFile(_File):
    """A local file, mapped read-only (its size checked against what the manifest says)."""

    def __init__(self, path: str, size: int) -> None:
        self.size = size
        with open(path, "rb") as f:
            actual = os.fstat(f.fileno()).st_size
            if actual != size:
                raise OSError(f"{path} has {actual} bytes, the manifest says {size}")
            self._map = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) if size else None

    def read(self, start: int, end: int) -> memoryview:
        if self._map is None:
            return memoryview(b"")
        return memoryview(self._map)[start:end]

    def tensor(self, start: int, end: int) -> torch.Tensor:
        """Bytes ``[start, end)`` as a uint8 tensor viewing the map (to send, not to write)."""
        if self._map is None or end == start:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer: gloo only reads it
            return torch.frombuffer(self._map, dtype=torch.uint8, count=end - start, offset=start)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere; the GC unmaps it
                pass


class PiecesFile(_File):
    """Some byte ranges of a file: ``[(start, buffer)]``; other ranges are not here."""

    def __init__(self, size: int, pieces: list[tuple[int, memoryview]]) -> None:
        self.size = size
        self.pieces = sorted(pieces, key=lambda p: p[0])

    def read(self, start: int, end: int) -> memoryview:
        for first, buf in self.pieces:
            if first <= start and end <= first + len(buf):
                return buf[start - first : end - first]
        raise FileNotFoundError(f"bytes [{start}, {end}) were not shipped to this rank")


class SnapshotFileSystem(AbstractFileSystem):
    protocol = PROTOCOL
    root_marker = ""
    _stores: ClassVar[dict[str, dict[str, _File]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3 :]
        return path.strip("/")

    def _files(self, path: str) -> tuple[str, dict[str, _File]]:
        path = self._strip_protocol(path)
        key = path.split("/", 1)[0]
        with self._lock:
            return path, self._stores.get(key, {})

    def _file(self, path: str) -> _File:
        path, files = self._files(path)
        found = files.get(path)
        if found is None:
            raise FileNotFoundError(path)
        return found

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any):
        f = self._file(path)
        if start is None and end is None:
            return bytes(f.read(0, f.size))
        start = 0 if start is None else start
        end = f.size if end is None else end
        if start < 0 or end > f.size or start > end:
            raise ValueError(f"{path}: bytes [{start}, {end}) are outside its {f.size} bytes")
        return f.read(start, end)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path, files = self._files(path)
        if path in files:
            return {"name": path, "size": files[path].size, "type": "file"}
        if any(name.startswith(path + "/") for name in files):
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path, files = self._files(path)
        children: dict[str, dict[str, Any]] = {}
        for name, f in files.items():
            if not name.startswith(path + "/"):
                continue
            rest = name[len(path) + 1 :]
            child = f"{path}/{rest.split('/', 1)[0]}"
            if "/" in rest:
                children.setdefault(child, {"name": child, "size": 0, "type": "directory"})
            else:
                children[child] = {"name": child, "size": f.size, "type": "file"}
        if not children and path not in files:
            raise FileNotFoundError(path)
        out = sorted(children.values(), key=lambda e: e["name"])
        return out if detail else [e["name"] for e in out]

    def find(self, path: str, maxdepth: Any = None, withdirs: bool = False, **kwargs: Any):
        path, files = self._files(path)
        found = {
            name: {"name": name, "size": f.size, "type": "file"}
            for name, f in sorted(files.items())
            if name.startswith(path + "/")
        }
        return found if kwargs.get("detail") else sorted(found)

    def invalidate_cache(self, path: str | None = None) -> None:
        pass


fsspec.register_implementation(PROTOCOL, SnapshotFileSystem, clobber=True)


def register(key: str, files: dict[str, _File]) -> str:
    """Make ``files`` (relative paths) readable under ``ckptmem://key``; returns that URL."""
    with SnapshotFileSystem._lock:
        SnapshotFileSystem._stores[key] = {f"{key}/{name}": f for name, f in files.items()}
    return f"{PROTOCOL}://{key}"


def release(key: str) -> None:
    with SnapshotFileSystem._lock:
        files = SnapshotFileSystem._stores.pop(key, {})
    for f in files.values():
        f.close()
