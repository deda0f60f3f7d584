"""``ckptmem://``: a per-process, read-only fsspec filesystem over memory-tier files.

A memory-tier resume (:mod:`ckpt.tiers.memory.restore`) hands the normal verified loader
(``ckpt.load``: manifest, ``.metadata``, every item's crc32c, resharding) a root whose
files are what this rank can reach without copying them first:

- a file on this node's tmpfs: a read-only ``mmap`` of it (a ranged read is a view of
  the page cache, no copy; the loader's checksum and its copy into the destination
  tensor read straight from it), except the values of tensor items this rank loads
  whole into their own memory, copied from the map straight into it (:class:`LocalFile`);
- a file from another node: only the byte ranges this rank's load plan reads, arriving
  over gloo in chunks (:class:`Arriving`); a read waits for the chunks it covers only,
  so the loader checks and copies the first bytes while the rest are still on the wire
  (a read outside the ranges fails, it never returns other bytes);
- small files (manifest.json, COMPLETE, ``.metadata``): bytes.

Ranged reads return ``memoryview`` objects (the loader takes any buffer); whole-file
reads return ``bytes``. The files live in a class-level registry under a key unique to
the restore, removed by :func:`release`.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import warnings
from typing import Any, ClassVar

import fsspec
import torch
from fsspec import AbstractFileSystem

from ckpt.loading.reader import Scattered
from ckpt.tiers.memory.layout import open_private

PROTOCOL = "ckptmem"


class SnapshotFile:
    size: int

    def read(self, start: int, end: int) -> memoryview:
        raise NotImplementedError

    def close(self) -> None:
        pass


class BytesFile(SnapshotFile):
    def __init__(self, data: bytes) -> None:
        self.data = bytes(data)
        self.size = len(self.data)

    def read(self, start: int, end: int) -> memoryview:
        return memoryview(self.data)[start:end]


class MappedFile(SnapshotFile):
    """A local file, mapped read-only (its size checked against what the manifest says)."""

    def __init__(self, path: str, size: int) -> None:
        self.size = size
        self.path = path
        with os.fdopen(open_private(path), "rb") as f:
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


class Arriving:
    """One byte range ``[start, start + len(buf))`` of a file, received in chunks into
    ``buf``: each chunk's pending receive (a ``torch.distributed`` work) is waited for
    exactly once, when a read first covers it (gloo's receive must not be waited twice),
    or by :meth:`settle`. A failed chunk fails every later read that covers it."""

    def __init__(self, start: int, buf: torch.Tensor, source: str) -> None:
        self.start = start
        self.buf = buf
        self.view = memoryview(buf.numpy()) if buf.numel() else memoryview(b"")
        self.source = source
        self.chunks: list[list[Any]] = []
        """``[first, end, work or None, error or None]`` per chunk (file offsets)."""
        self.waited_s = 0.0
        """Seconds reads spent waiting for chunks to arrive."""
        self._lock = threading.Lock()

    @property
    def end(self) -> int:
        return self.start + self.view.nbytes

    def add(self, first: int, end: int, work: Any) -> None:
        self.chunks.append([first, end, work, None])

    def wait(self, start: int, end: int) -> None:
        """Block until bytes ``[start, end)`` are here; raises if any of their chunks failed."""
        with self._lock:
            began = time.perf_counter()
            for chunk in self.chunks:
                if chunk[0] < end and start < chunk[1]:
                    self._settle(chunk)
            self.waited_s += time.perf_counter() - began
            bad = [c for c in self.chunks if c[0] < end and start < c[1] and c[3]]
        if bad:
            first, last, _, error = bad[0]
            raise OSError(f"bytes [{first}, {last}) from {self.source} did not arrive: {error}")

    def settle(self) -> str | None:
        """Wait for every chunk (before the buffer may go); the first error, if any."""
        with self._lock:
            for chunk in self.chunks:
                self._settle(chunk)
            return next((c[3] for c in self.chunks if c[3]), None)

    @staticmethod
    def _settle(chunk: list[Any]) -> None:
        work = chunk[2]
        if work is None:
            return
        chunk[2] = None
        try:
            work.wait()
        except Exception as exc:  # a dead peer, a broken connection: the chunk is missing
            chunk[3] = f"{type(exc).__name__}: {exc}"


class _MapCopy:
    """A deferred copy of bytes ``[offset, offset + len(dst))`` of a mapped file into
    ``dst``: a work like a receive's, done by the first :meth:`wait` (:meth:`Arriving.wait`
    calls it once, when a read first covers those bytes)."""

    __slots__ = ("dst", "mapped", "offset")

    def __init__(self, mapped: MappedFile, dst: torch.Tensor, offset: int) -> None:
        self.mapped, self.dst, self.offset = mapped, dst, offset

    def wait(self) -> None:
        self.dst.copy_(self.mapped.tensor(self.offset, self.offset + self.dst.numel()))


class LocalFile(SnapshotFile):
    """A file on this node's tmpfs, as :class:`MappedFile`, except the values of the tensor
    items this rank loads whole into their own memory (``segments``: ``(start, end,
    destination bytes)``; ``placed``: item offset -> ``(offset, bytes)`` of those values,
    as :class:`PiecesFile` has them): those are copied from the map straight into the
    destination when the loader first reads them, and a read across them returns a
    :class:`~ckpt.loading.reader.Scattered` of map views and destinations, which the loader
    checks (in the destination, after the copy) and uses in place: one copy, no buffer.

    Why a copy from the map and not a ``read``: with the pages as a save leaves them the
    map's copy takes about half the time of a ``preadv`` (tmpfs reads go page by page).
    After a page-cache drop (``drop_caches``, or ``POSIX_FADV_DONTNEED`` on the file) the
    map's copy is no faster than the read, as the kernel's fault-around skips pages it
    marked for reclaim (see ``bench.memory_tier.AFTER_DROP``).
    """

    def __init__(
        self,
        mapped: MappedFile,
        segments: list[tuple[int, int, torch.Tensor]],
        placed: dict[int, tuple[int, int]],
    ) -> None:
        self.mapped = mapped
        self.size = mapped.size
        self.placed = placed
        self.in_place_bytes = sum(end - start for start, end, _ in segments)
        self.pieces: list[Arriving] = []
        for start, end, buf in sorted(segments, key=lambda s: s[0]):
            piece = Arriving(start, buf, f"the map of {mapped.path}")
            piece.add(start, end, _MapCopy(mapped, buf, start))
            self.pieces.append(piece)

    def read(self, start: int, end: int) -> memoryview | Scattered:
        parts: list[tuple[int, torch.Tensor]] = []
        at = start
        for piece in self.pieces:
            if piece.end <= at or piece.start >= end:
                continue
            if piece.start > at:
                parts.append((at, self.mapped.tensor(at, piece.start)))
            lo, hi = max(at, piece.start), min(end, piece.end)
            piece.wait(lo, hi)
            parts.append((lo, piece.buf[lo - piece.start : hi - piece.start]))
            at = hi
        if not parts:
            return self.mapped.read(start, end)
        if at < end:
            parts.append((at, self.mapped.tensor(at, end)))
        return Scattered(start, parts, self.placed)

    def close(self) -> None:
        """Close the map; a value never read is not read now."""
        self.mapped.close()


class PiecesFile(SnapshotFile):
    """Some byte ranges of a file, arriving (:class:`Arriving`); other ranges are not here.

    A range may arrive as consecutive pieces, some of them a tensor item's values
    received straight into their destination (``placed``: item offset -> ``(offset,
    bytes)`` of those values); a read across pieces returns a
    :class:`~ckpt.loading.reader.Scattered` of them, which the loader checks and uses in place.
    """

    def __init__(
        self,
        size: int,
        pieces: list[Arriving],
        placed: dict[int, tuple[int, int]] | None = None,
    ) -> None:
        self.size = size
        self.pieces = sorted(pieces, key=lambda p: p.start)
        self.placed = placed or {}

    def read(self, start: int, end: int) -> memoryview | Scattered:
        for piece in self.pieces:
            if piece.start <= start and end <= piece.end:
                piece.wait(start, end)
                return piece.view[start - piece.start : end - piece.start]
        parts: list[tuple[int, torch.Tensor]] = []
        at = start
        for piece in self.pieces:
            if piece.start <= at < piece.end:
                last = min(end, piece.end)
                piece.wait(at, last)
                parts.append((at, piece.buf[at - piece.start : last - piece.start]))
                at = last
                if at == end:
                    return Scattered(start, parts, self.placed)
        raise FileNotFoundError(f"bytes [{start}, {end}) were not shipped to this rank")

    def close(self) -> None:
        for piece in self.pieces:
            piece.settle()


class SnapshotFileSystem(AbstractFileSystem):
    """``ckptmem://KEY/...``: the files :func:`register` put under KEY, until :func:`release`.

    fsspec builds filesystems from a URL itself, so the open snapshots are kept on the
    class (keyed by a per-restore KEY, emptied by ``release``): the one place in ``ckpt``
    where a registry outlives an owner object, as fsspec's protocol model requires.
    """

    protocol = PROTOCOL
    root_marker = ""
    _stores: ClassVar[dict[str, dict[str, SnapshotFile]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3 :]
        return path.strip("/")

    def _files(self, path: str) -> tuple[str, dict[str, SnapshotFile]]:
        path = self._strip_protocol(path)
        key = path.split("/", 1)[0]
        with self._lock:
            return path, self._stores.get(key, {})

    def _file(self, path: str) -> SnapshotFile:
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
        end = f.size if end is None else min(end, f.size)  # like a file: a read stops at EOF
        if start < 0 or start > end:
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


def install() -> None:
    """Tell fsspec that ``ckptmem://`` is :class:`SnapshotFileSystem` (idempotent).

    Not done at import: :class:`~ckpt.tiers.memory.tier.MemoryTier` calls it when constructed
    and :func:`register` before it hands out a ``ckptmem://`` URL, so a fresh process
    that loads a snapshot has the protocol before fsspec resolves it.
    """
    if fsspec.registry.get(PROTOCOL) is not SnapshotFileSystem:
        fsspec.register_implementation(PROTOCOL, SnapshotFileSystem, clobber=True)


def register(key: str, files: dict[str, SnapshotFile]) -> str:
    """Make ``files`` (relative paths) readable under ``ckptmem://key``; returns that URL."""
    install()
    with SnapshotFileSystem._lock:
        SnapshotFileSystem._stores[key] = {f"{key}/{name}": f for name, f in files.items()}
    return f"{PROTOCOL}://{key}"


def release(key: str) -> None:
    """Forget the files under ``key``: every receive settled here (gloo may still write
    into a piece until then); the maps are closed by a background thread (unmapping a
    few hundred MB of page tables takes tens of milliseconds, which the resume need not
    wait for)."""
    with SnapshotFileSystem._lock:
        files = SnapshotFileSystem._stores.pop(key, {})
    maps = [f for f in files.values() if isinstance(f, MappedFile | LocalFile)]
    for f in files.values():
        if not isinstance(f, MappedFile | LocalFile):
            f.close()
    if maps:
        threading.Thread(
            target=lambda: [f.close() for f in maps], name="ckptmem-unmap", daemon=True
        ).start()
