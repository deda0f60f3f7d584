"""Objects cut into parts without copies: what the GCS and S3 backends upload in parallel.

A producer (``torch.save`` through the shard writer) streams an object's bytes into a
:class:`PartSink`. Buffers of at least :data:`ZERO_COPY_MIN_BYTES` are *held* as
``memoryview`` s, not copied (smaller pieces, zip headers mostly, are gathered in a
small staging buffer), and cut at part boundaries. Once the object is known to be
larger than the parallel threshold, every full part is handed to ``on_part`` while the
producer goes on, so uploads overlap serialization.

The producer must keep the memory behind the buffers it writes alive and unchanged
until the upload returns (``bytes`` are kept alive by the views themselves; raw
buffers such as a tensor's storage handed out by ``torch.save`` are not, so the shard
writer registers the tensors with ``stream.keep_alive``).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckpt.format.checksum import ChecksummingWriter, crc32c_extend
from ckpt.storage.base import Calls, Produce
from ckpt.storage.fsspec_generic import FsspecBackend

ZERO_COPY_MIN_BYTES = 64 << 10
"""Buffers at least this large are sent as they are; smaller ones are copied (cheap)."""


class Part:
    """Buffers of one part: views held, not copied; size, and crc32c once computed."""

    __slots__ = ("buffers", "crc", "owners", "size")

    def __init__(self, owners: list[Any]) -> None:
        self.buffers: list[memoryview | bytes] = []
        self.size = 0
        self.crc: int | None = None
        # The owners of raw buffers live as long as any part does (also in an upload
        # thread abandoned after a timeout, which may still be reading the views).
        self.owners = owners


class PartSink:
    """Raw stream under a :class:`~ckpt.format.checksum.ChecksummingWriter`: cuts what is
    written into parts.

    ``write`` holds large buffers as views and copies small ones; every full part is
    handed to ``on_part`` (which may start uploading it) once more than
    ``parallel_min_bytes`` were written (the object will be uploaded in parts).
    """

    def __init__(
        self, part_bytes: int, parallel_min_bytes: int, on_part: Callable[[int, Part], None]
    ) -> None:
        self._part_bytes = part_bytes
        self._parallel_min = parallel_min_bytes
        self.size = 0
        self._on_part = on_part
        self.owners: list[Any] = []
        """Objects that own raw buffers written here; kept alive as long as the parts."""
        self._parts: list[Part] = [Part(self.owners)]
        self._small = bytearray()
        self._flushed_to = 0  # parts handed to on_part

    def keep_alive(self, owner: Any) -> None:
        self.owners.append(owner)

    def _add(self, piece: memoryview | bytes) -> None:
        """Append ``piece`` to the open part(s), splitting at part boundaries."""
        view = memoryview(piece).cast("B")
        while view.nbytes:
            part = self._parts[-1]
            room = self._part_bytes - part.size
            if room == 0:
                self._parts.append(Part(self.owners))
                continue
            take = view[:room] if view.nbytes > room else view
            part.buffers.append(take)
            part.size += take.nbytes
            self.size += take.nbytes
            view = view[take.nbytes :]
        if self.size > self._parallel_min:
            self._hand_off()

    def _flush_small(self) -> None:
        if self._small:
            data = bytes(self._small)
            self._small.clear()
            self._add(data)

    def _hand_off(self) -> None:
        # Every part before the open one is full and final.
        while self._flushed_to < len(self._parts) - 1:
            self._on_part(self._flushed_to, self._parts[self._flushed_to])
            self._flushed_to += 1

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n >= ZERO_COPY_MIN_BYTES:
            self._flush_small()
            self._add(view)
        else:
            self._small += view
        return n

    def flush(self) -> None:
        pass

    def close(self) -> list[Part]:
        """The parts (the last one possibly short), or one part holding everything
        when the object is not larger than ``parallel_min_bytes``."""
        self._flush_small()
        if self.size > self._parallel_min or len(self._parts) == 1:
            return self._parts
        whole = Part(self.owners)
        for part in self._parts:
            whole.buffers += part.buffers
            whole.size += part.size
        return [whole]

    @property
    def handed_off(self) -> int:
        return self._flushed_to


def part_crc(part: Part) -> int:
    """crc32c of a part's bytes, computed once, in the thread that uploads it (one
    request of a whole object is checked against the stream's crc32c instead)."""
    if part.crc is None:
        crc = 0
        for buffer in part.buffers:
            crc = crc32c_extend(crc, buffer)
        part.crc = crc
    return part.crc


def wait_all(futures: dict[int, Future[Any]], *, raise_first: bool = True) -> None:
    """Wait for every future not cancelled; raise the first error (by index) if asked."""
    first: BaseException | None = None
    for index in sorted(futures):
        future = futures[index]
        if future.cancelled():
            continue
        try:
            future.result()
        except BaseException as exc:
            if first is None:
                first = exc
    if first is not None and raise_first:
        raise first


def fresh_buffer(nbytes: int) -> bytearray | mmap.mmap:
    """A writable buffer of ``nbytes`` whose pages are first touched by the download.

    A large one is an anonymous ``mmap``: ``bytearray(n)`` zero-fills every page before
    the download writes it, a second pass over the memory for nothing.
    """
    if nbytes < ZERO_COPY_MIN_BYTES:
        return bytearray(nbytes)
    return mmap.mmap(-1, nbytes)


def read_exactly_into(stream: Any, into: memoryview) -> int:
    """Fill ``into`` from ``stream`` (``readinto``) until it is full or the stream ends;
    returns how many bytes came."""
    got = 0
    while got < into.nbytes:
        n = stream.readinto(into[got:])
        if not n:
            break
        got += n
    return got


def ranges(start: int, end: int, step: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into consecutive ranges of at most ``step`` bytes."""
    return [(lo, min(end, lo + step)) for lo in range(start, end, step)]


class ParallelTransfer:
    """Writes through a :class:`PartSink` and parallel ranged reads, for one object store.

    A subclass says how one object goes up in one request (:meth:`put_whole`), how a
    parted upload starts, sends a part, finishes and is cleaned up (:meth:`start_parts`,
    :meth:`put_part`, :meth:`finish_parts`, :meth:`end_parts`), and how one byte range is
    read into a buffer (:meth:`get_range_into`). Each of those requests runs through the
    storage's ``calls`` (timeout, retries, faults), so a part that fails is retried alone.

    ``options`` has ``parallel_min_bytes``, ``part_bytes``, ``workers`` and
    ``read_part_bytes``. Shared by a storage and its children (thread pool per process).
    """

    scheme = ""

    def __init__(self, options: Any) -> None:
        self.options = options
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._pid = os.getpid()

    def executor(self) -> ThreadPoolExecutor:
        if os.getpid() != self._pid:  # a forked child has none of the parent's threads
            self._pool, self._pool_lock, self._pid = None, threading.Lock(), os.getpid()
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.options.workers, thread_name_prefix=f"ckpt-{self.scheme}"
                )
            return self._pool

    def url(self, path: str) -> str:
        return f"{self.scheme}://{path}"

    # -- what a store implements ----------------------------------------------------------

    def put_whole(
        self, path: str, part: Part, stream: ChecksummingWriter, calls: Calls, phase: str
    ) -> None:
        raise NotImplementedError

    def start_parts(self, path: str, calls: Calls, phase: str) -> Any:
        """Begin a parted upload of ``path``; returns what the other part calls get."""
        raise NotImplementedError

    def put_part(
        self, upload: Any, path: str, index: int, part: Part, calls: Calls, phase: str
    ) -> None:
        raise NotImplementedError

    def finish_parts(
        self, upload: Any, path: str, parts: list[Part], stream: ChecksummingWriter, calls: Calls
    ) -> None:
        """Assemble the object from its parts and check it against the stream."""
        raise NotImplementedError

    def end_parts(self, upload: Any, path: str, count: int, finished: bool, calls: Calls) -> None:
        """Clean up after a parted upload (also when it failed); best effort."""
        raise NotImplementedError

    def get_range_into(self, path: str, start: int, into: memoryview) -> None:
        """One request: bytes ``[start, start + len(into))`` into ``into``."""
        raise NotImplementedError

    # -- writes ---------------------------------------------------------------------------

    def write(self, path: str, produce: Produce, calls: Calls, *, phase: str) -> tuple[int, str]:
        """Upload what ``produce`` streams as ``path``: one request up to
        ``parallel_min_bytes``, else parts sent while the producer goes on."""
        futures: dict[int, Future[None]] = {}
        pool = self.executor()
        inflight = threading.BoundedSemaphore(self.options.workers * 2)
        upload: list[Any] = []

        def send(index: int, part: Part) -> None:
            try:
                self.put_part(upload[0], path, index, part, calls, phase)
            finally:
                inflight.release()

        def on_part(index: int, part: Part) -> None:
            # Bounded: at most 2 x workers parts queued or in flight (their copies of small
            # pieces are all that costs memory; large buffers are views).
            if any(f.done() and not f.cancelled() and f.exception() for f in futures.values()):
                return  # a part gave up: send no more (raising here would go through
                # torch.save, which rewraps errors); the wait below raises its error
            if not upload:
                upload.append(self.start_parts(path, calls, phase))
            inflight.acquire()
            futures[index] = pool.submit(send, index, part)

        sink = PartSink(self.options.part_bytes, self.options.parallel_min_bytes, on_part)
        stream = ChecksummingWriter(sink)
        stream.keep_alive = sink.keep_alive  # type: ignore[attr-defined]
        finished = False
        try:
            produce(stream)
            parts = sink.close()
            if len(parts) == 1:
                self.put_whole(path, parts[0], stream, calls, phase)
            else:
                for index in range(sink.handed_off, len(parts)):
                    on_part(index, parts[index])
                wait_all(futures)
                self.finish_parts(upload[0], path, parts, stream, calls)
            finished = True
        finally:
            for future in futures.values():
                future.cancel()
            wait_all(futures, raise_first=False)
            if upload:
                self.end_parts(upload[0], path, len(sink.close()), finished, calls)
        return stream.size, stream.crc32c

    # -- reads ----------------------------------------------------------------------------

    def read_range(
        self, path: str, start: int, end: int, calls: Calls, *, phase: str
    ) -> bytearray | mmap.mmap:
        """Bytes ``[start, end)`` into a fresh buffer (:meth:`read_into`)."""
        out = fresh_buffer(end - start)
        self.read_into(path, start, memoryview(out), calls, phase=phase)
        return out

    def read_into(
        self, path: str, start: int, into: memoryview, calls: Calls, *, phase: str
    ) -> None:
        """Bytes ``[start, start + len(into))`` into ``into``: ranges of ``read_part_bytes``
        in parallel (``workers``), each one retried request."""
        end = start + into.nbytes

        def fetch(lo: int, hi: int) -> None:
            calls.call(
                f"read {self.url(path)}[{lo}:{hi}]",
                phase,
                lambda: self.get_range_into(path, lo, into[lo - start : hi - start]),
            )

        pieces = ranges(start, end, self.options.read_part_bytes)
        if len(pieces) <= 1:
            for lo, hi in pieces:
                fetch(lo, hi)
            return
        futures = dict(enumerate(self.executor().submit(fetch, lo, hi) for lo, hi in pieces))
        wait_all(futures)

    def read_pipeline(self) -> tuple[int | None, int]:
        """Spans of one ranged request each, ``workers`` in flight, into recycled buffers,
        so a load of any size touches only that many buffers' pages (page faults on
        fresh buffers were a third of a 128 MiB download from the GCS emulator)."""
        return self.options.read_part_bytes, self.options.workers


def transfer_options(options: Any, kind: type, url: str, fallback: Any = None) -> Any:
    """The backend's tuning from ``StorageOptions.transfer`` (else ``fallback``, else
    ``kind``'s defaults); another backend's tuning object is a ``ValueError``."""
    tuning = options.transfer if options.transfer is not None else fallback
    if tuning is None:
        return kind()
    if not isinstance(tuning, kind):
        raise ValueError(
            f"{url}: StorageOptions.transfer must be a {kind.__name__} for this URL, "
            f"got {type(tuning).__name__}"
        )
    return tuning


class TransferBackend(FsspecBackend):
    """An fsspec backend whose object bytes go through a :class:`ParallelTransfer`
    (listings, deletes and moves stay the filesystem's)."""

    def __init__(self, fs: Any, options: Any, transfer: ParallelTransfer) -> None:
        super().__init__(fs, options)
        self.scheme = transfer.scheme
        self.transfer = transfer

    def write(self, path: str, produce: Produce, calls: Calls, *, phase: str) -> tuple[int, str]:
        return self.transfer.write(path, produce, calls, phase=phase)

    def read_range(self, path: str, start: int, end: int, calls: Calls, *, phase: str) -> Any:
        return self.transfer.read_range(path, start, end, calls, phase=phase)

    def read_into(
        self, path: str, start: int, into: memoryview, calls: Calls, *, phase: str
    ) -> None:
        self.transfer.read_into(path, start, into, calls, phase=phase)

    def read_pipeline(self) -> tuple[int | None, int]:
        return self.transfer.read_pipeline()
