"""GCS objects at line rate: zero-copy uploads, parallel parts + compose, parallel ranged reads.

:class:`~ckpt.storage.Storage` sends every ``gs://`` object write and ranged read
through here (JSON API over plain ``http.client``, credentials and endpoint from the
gcsfs filesystem the storage already holds):

- Writes: the bytes a producer streams are *held*, not copied: a buffer of at least
  ``ZERO_COPY_MIN_BYTES`` becomes a ``memoryview`` that is sent as the request body
  (smaller pieces, zip headers mostly, are copied into a small staging buffer). An
  object of at most ``parallel_min_bytes`` goes up in one request (``uploadType=media``);
  a larger one is cut into ``part_bytes`` parts uploaded in parallel (``workers``
  threads per rank) to temporary objects ``<dir>/.parts/<name>.<token>.<index>``,
  then assembled server-side with ``compose`` (32 components per call; more parts
  are composed in levels). Each part, the compose and each part delete is one
  storage call with the storage's timeout, retries and fault injection, so a part
  that fails is retried alone.
- Integrity without re-reading: each part's crc32c is computed from the held buffers
  by the thread that uploads it and compared with the crc32c the server reports for
  the uploaded part (a mismatch is a transient
  :class:`~ckpt.errors.WriteVerificationError`: that part is sent again); the composed object's server-reported crc32c (GCS combines the parts')
  must equal the crc32c streamed for the whole object (what the manifest records),
  or the write fails before COMPLETE can be written.
- Temporary parts are deleted after the compose, also when it or an upload failed.
  A process killed mid-upload leaves them inside the checkpoint directory, which
  then has no COMPLETE: the next save of that step clears the directory, retention
  and ``python -m ckpt gc`` delete it once a newer checkpoint is committed.
  Discovery ignores them (it only reads COMPLETE and manifest.json).
- Reads: a range above ``read_part_bytes`` is fetched as that many byte ranges in
  parallel (``workers`` threads) straight into one buffer (``read_into`` writes into
  the caller's buffer: the shard reader recycles a few, see
  :meth:`~ckpt.storage.Storage.read_pipeline`).

The producer must keep the memory behind the buffers it writes alive and unchanged
until the write returns (``bytes`` are kept alive by the views themselves; raw
buffers such as a tensor's storage handed out by ``torch.save`` are not, so the
shard writer registers the tensors with ``stream.keep_alive``).

Why (measured on fake-gcs-server, 2 cores, see BENCHMARKS.md): gcsfs ``pipe`` of
128 MiB took 1.9-3.0 s, one ``http.client`` request with a memoryview body 0.23-0.26 s;
gcsfs copies each byte into its upload buffers and again per request.

Tuning: :class:`GcsTransferOptions`, passed as ``StorageOptions(gcs=...)``.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import mmap
import os
import queue
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

from ckpt.checksum import ChecksummingWriter
from ckpt.checksum import crc32c_extend as _crc_extend  # the fastest crc32c here, any buffer
from ckpt.errors import StorageError, WriteVerificationError

if TYPE_CHECKING:
    from ckpt.storage import FileRecord, Storage

logger = logging.getLogger(__name__)

PARALLEL_MIN_BYTES = 150 << 20
PART_BYTES = 50 << 20
"""Threshold and part size: the defaults of ``gcloud storage``'s parallel composite
uploads (``parallel_composite_upload_threshold`` 150M, ``..._component_size`` 50M)."""
WORKERS = 4
READ_PART_BYTES = 16 << 20
COMPOSE_MAX_COMPONENTS = 32
"""GCS accepts at most 32 source objects per compose request."""
ZERO_COPY_MIN_BYTES = 64 << 10
"""Buffers at least this large are sent as they are; smaller ones are copied (cheap)."""
PARTS_DIRNAME = ".parts"
"""Temporary part objects live in ``<checkpoint dir>/.parts/`` until composed."""


def part_key(key: str, token: str, index: int) -> str:
    """Name of part ``index`` of the object ``key`` (relative to the same directory)."""
    return f"{PARTS_DIRNAME}/{key}.{token}.{index:05d}"


def is_part_key(relative_path: str) -> bool:
    """Whether a path below a checkpoint directory is a temporary upload part."""
    return relative_path.split("/", 1)[0] == PARTS_DIRNAME


@dataclass(frozen=True, slots=True, kw_only=True)
class GcsTransferOptions:
    """How GCS objects are cut into parallel requests."""

    parallel_min_bytes: int = PARALLEL_MIN_BYTES
    """Objects larger than this go up as parallel parts, then compose; others in one request."""
    part_bytes: int = PART_BYTES
    """Size of a part (the last one may be shorter)."""
    workers: int = WORKERS
    """Parallel requests per process (part uploads, part deletes, ranged reads)."""
    read_part_bytes: int = READ_PART_BYTES
    """Ranged reads larger than this are split into parallel requests of this size."""

    def __post_init__(self) -> None:
        if self.parallel_min_bytes < 0:
            raise ValueError(f"parallel_min_bytes must be >= 0, got {self.parallel_min_bytes}")
        for name in ("part_bytes", "workers", "read_part_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class GcsHttpError(OSError):
    """A GCS JSON API request answered with an error status (``code``)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"HTTP {code}: {message}")
        self.code = code


class GcsClient:
    """The few JSON API calls the checkpoint needs, over pooled ``http.client`` connections.

    Endpoint (``STORAGE_EMULATOR_HOST`` or storage.googleapis.com) and credential
    headers come from the gcsfs filesystem, asked on every request (tokens refresh).
    Calls: ``objects.insert`` (media upload), ``objects.compose``, ``objects.delete``,
    ``objects.get`` (``alt=media`` with a Range header).
    """

    def __init__(self, fs: Any, timeout_s: float) -> None:
        self._fs = fs
        self._timeout_s = timeout_s
        self._idle: queue.LifoQueue[http.client.HTTPConnection] = queue.LifoQueue()
        self._lock = threading.Lock()
        self._origin: str | None = None
        self._pid = os.getpid()

    # -- connections ------------------------------------------------------------------

    def _connection(self) -> http.client.HTTPConnection:
        origin = str(self._fs._location).rstrip("/")
        if os.getpid() != self._pid:  # a forked child: the parent's sockets are not ours
            self._idle, self._lock, self._pid = queue.LifoQueue(), threading.Lock(), os.getpid()
        with self._lock:
            if origin != self._origin:  # the endpoint moved (tests): drop old connections
                self._origin = origin
                self._drain()
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        parts = urlsplit(origin)
        if parts.scheme == "https":
            return http.client.HTTPSConnection(parts.netloc, timeout=self._timeout_s)
        return http.client.HTTPConnection(parts.netloc, timeout=self._timeout_s)

    def _drain(self) -> None:
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return

    def _headers(self, extra: dict[str, str]) -> dict[str, str]:
        return self._fs._get_headers(extra)

    def _request(
        self,
        method: str,
        url: str,
        *,
        body: Any = None,
        headers: dict[str, str] | None = None,
        into: memoryview | None = None,
        ok: tuple[int, ...] = (200,),
    ) -> bytes | None:
        """One request; the answer's body (or, with ``into``, read into that buffer)."""
        conn = self._connection()
        reusable = False
        try:
            conn.request(method, url, body=body, headers=self._headers(headers or {}))
            response = conn.getresponse()
            if response.status not in ok:
                text = response.read()[:500].decode(errors="replace")
                reusable = True
                if response.status == 404:
                    raise FileNotFoundError(f"{method} {url}: 404 {text}")
                raise GcsHttpError(response.status, f"{method} {url}: {text}")
            if into is not None:
                got = 0
                while got < into.nbytes:
                    n = response.readinto(into[got:])
                    if not n:
                        break
                    got += n
                if got != into.nbytes or response.read(1):
                    raise WriteVerificationError(
                        f"{method} {url}: expected {into.nbytes} bytes, got {got} or more"
                    )
                data = None
            else:
                data = response.read()
            reusable = not response.will_close
            return data
        except http.client.HTTPException as exc:  # a torn response: retry like a reset
            raise ConnectionResetError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        finally:
            if reusable:
                self._idle.put(conn)
            else:
                conn.close()

    def _object_url(self, bucket: str, name: str) -> str:
        return f"/storage/v1/b/{quote(bucket, safe='')}/o/{quote(name, safe='')}"

    # -- the API calls ----------------------------------------------------------------

    def upload(self, bucket: str, name: str, body: list[memoryview | bytes]) -> dict[str, Any]:
        """``objects.insert`` (one media upload); returns the object resource."""
        size = sum(len(memoryview(b).cast("B")) for b in body)
        url = (
            f"/upload/storage/v1/b/{quote(bucket, safe='')}/o?uploadType=media"
            f"&name={quote(name, safe='')}"
        )
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        raw = self._request("POST", url, body=iter(body), headers=headers)
        return json.loads(raw or b"{}")

    def compose(self, bucket: str, name: str, sources: list[str]) -> dict[str, Any]:
        """``objects.compose`` of ``sources`` (at most 32) into ``name``; the new resource."""
        if len(sources) > COMPOSE_MAX_COMPONENTS:
            raise ValueError(f"compose takes at most {COMPOSE_MAX_COMPONENTS} sources")
        payload = json.dumps(
            {
                "sourceObjects": [{"name": s} for s in sources],
                "destination": {"contentType": "application/octet-stream"},
            }
        ).encode()
        raw = self._request(
            "POST",
            self._object_url(bucket, name) + "/compose",
            body=payload,
            headers={"Content-Type": "application/json"},
        )
        return json.loads(raw or b"{}")

    def delete(self, bucket: str, name: str) -> None:
        """``objects.delete``; a missing object is fine."""
        try:
            self._request("DELETE", self._object_url(bucket, name), ok=(200, 204))
        except FileNotFoundError:
            pass

    def upload_if_generation(
        self, bucket: str, name: str, data: bytes, generation: int
    ) -> dict[str, Any]:
        """``objects.insert`` of a small object only if its generation is ``generation``
        (0: only if it does not exist); a multipart upload, the kind whose precondition the
        emulator honours too. Another generation: ``GcsHttpError`` 412."""
        boundary = uuid.uuid4().hex
        head = (
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
            f"{json.dumps({'name': name})}\r\n--{boundary}\r\n"
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        body = head + data + f"\r\n--{boundary}--\r\n".encode()
        url = (
            f"/upload/storage/v1/b/{quote(bucket, safe='')}/o?uploadType=multipart"
            f"&ifGenerationMatch={int(generation)}"
        )
        headers = {
            "Content-Type": f"multipart/related; boundary={boundary}",
            "Content-Length": str(len(body)),
        }
        raw = self._request("POST", url, body=body, headers=headers)
        return json.loads(raw or b"{}")

    def get_with_generation(self, bucket: str, name: str, max_bytes: int) -> tuple[bytes, int]:
        """A small object's bytes and its generation (``x-goog-generation``); 404:
        ``FileNotFoundError``; larger than ``max_bytes``: ``ValueError``."""
        conn = self._connection()
        try:
            url = self._object_url(bucket, name) + "?alt=media"
            conn.request("GET", url, headers=self._headers({}))
            response = conn.getresponse()
            data = response.read(max_bytes + 1)
            if response.status == 404:
                raise FileNotFoundError(f"GET {url}: 404")
            if response.status != 200:
                raise GcsHttpError(response.status, f"GET {url}: {data[:500]!r}")
            if len(data) > max_bytes:
                raise ValueError(f"gs://{bucket}/{name} is larger than {max_bytes} bytes")
            return data, int(response.getheader("x-goog-generation") or 0)
        except http.client.HTTPException as exc:
            raise ConnectionResetError(f"GET {name}: {type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()

    def delete_if_generation(self, bucket: str, name: str, generation: int) -> None:
        """``objects.delete`` only if the object is at ``generation``; another generation
        (412) or none (404) leaves things as they are."""
        url = self._object_url(bucket, name) + f"?ifGenerationMatch={int(generation)}"
        try:
            self._request("DELETE", url, ok=(200, 204))
        except FileNotFoundError:
            pass
        except GcsHttpError as exc:
            if exc.code != 412:
                raise

    def read_into(self, bucket: str, name: str, start: int, into: memoryview) -> None:
        """Bytes ``[start, start + len(into))`` of the object, into ``into``."""
        end = start + into.nbytes - 1
        self._request(
            "GET",
            self._object_url(bucket, name) + "?alt=media",
            headers={"Range": f"bytes={start}-{end}"},
            into=into,
            ok=(200, 206) if start == 0 else (206,),
        )


class _Part:
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
    """Raw stream under a :class:`ChecksummingWriter`: cuts what is written into parts.

    ``write`` holds large buffers as views and copies small ones; every full part is
    handed to ``on_part`` (which may start uploading it) once more than
    ``parallel_min_bytes`` were written (the object will be uploaded in parts).
    """

    def __init__(
        self, part_bytes: int, parallel_min_bytes: int, on_part: Callable[[int, _Part], None]
    ) -> None:
        self._part_bytes = part_bytes
        self._parallel_min = parallel_min_bytes
        self.size = 0
        self._on_part = on_part
        self.owners: list[Any] = []
        """Objects that own raw buffers written here; kept alive as long as the parts."""
        self._parts: list[_Part] = [_Part(self.owners)]
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
                self._parts.append(_Part(self.owners))
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

    def close(self) -> list[_Part]:
        """The parts (the last one possibly short), or one part holding everything
        when the object is not larger than ``parallel_min_bytes``."""
        self._flush_small()
        if self.size > self._parallel_min or len(self._parts) == 1:
            return self._parts
        whole = _Part(self.owners)
        for part in self._parts:
            whole.buffers += part.buffers
            whole.size += part.size
        return [whole]

    @property
    def handed_off(self) -> int:
        return self._flushed_to


def part_crc(part: _Part) -> int:
    """crc32c of a part's bytes, computed once, in the thread that uploads it (one
    request of a whole object is checked against the stream's crc32c instead)."""
    if part.crc is None:
        crc = 0
        for buffer in part.buffers:
            crc = _crc_extend(crc, buffer)
        part.crc = crc
    return part.crc


def _encode(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


class GcsTransfer:
    """Parallel, zero-copy object transfers for one :class:`Storage` on ``gs://``.

    Shared by a storage and its children; holds a connection pool and a thread pool.
    """

    def __init__(self, storage: Storage, options: GcsTransferOptions) -> None:
        self.options = options
        self.client = GcsClient(storage.fs, storage.options.timeout_s)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._pid = os.getpid()

    def _executor(self) -> ThreadPoolExecutor:
        if os.getpid() != self._pid:  # a forked child has none of the parent's threads
            self._pool, self._pool_lock, self._pid = None, threading.Lock(), os.getpid()
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.options.workers, thread_name_prefix="ckpt-gcs"
                )
            return self._pool

    # -- writes -----------------------------------------------------------------------

    def write(
        self,
        storage: Storage,
        key: str,
        produce: Callable[[ChecksummingWriter], None],
        *,
        phase: str,
    ) -> FileRecord:
        """Upload what ``produce`` streams as the object ``key``; verified on return."""
        from ckpt.storage import FileRecord

        bucket, name = _split(storage.path(key))
        token = uuid.uuid4().hex[:12]
        futures: dict[int, Future[None]] = {}
        pool = self._executor()
        inflight = threading.BoundedSemaphore(self.options.workers * 2)

        def upload_part(index: int, part: _Part) -> None:
            try:
                self._upload_part(storage, key, part_key(key, token, index), part, phase)
            finally:
                inflight.release()

        def on_part(index: int, part: _Part) -> None:
            # Bounded: at most 2 x workers parts queued or in flight (their copies of small
            # pieces are all that costs memory; large buffers are views).
            if any(f.done() and not f.cancelled() and f.exception() for f in futures.values()):
                return  # a part gave up: send no more (raising here would go through
                # torch.save, which rewraps errors); the wait below raises its error
            inflight.acquire()
            futures[index] = pool.submit(upload_part, index, part)

        sink = PartSink(self.options.part_bytes, self.options.parallel_min_bytes, on_part)
        stream = ChecksummingWriter(sink)
        stream.keep_alive = sink.keep_alive  # type: ignore[attr-defined]
        try:
            produce(stream)
            parts = sink.close()
            if len(parts) == 1:
                self._upload_whole(storage, key, parts[0], stream, phase)
            else:
                for index in range(sink.handed_off, len(parts)):
                    on_part(index, parts[index])
                self._wait(futures)
                self._compose(storage, key, token, parts, stream)
        finally:
            for future in futures.values():
                future.cancel()
            self._wait(futures, raise_first=False)
            if futures:
                self._remove_parts(storage, key, token, len(sink.close()))
        logger.debug("gcs: wrote gs://%s/%s (%d bytes)", bucket, name, stream.size)
        return FileRecord(key, stream.size, stream.crc32c)

    def _wait(self, futures: dict[int, Future[None]], *, raise_first: bool = True) -> None:
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

    def _upload_part(self, storage: Storage, key: str, pkey: str, part: _Part, phase: str) -> None:
        bucket, name = _split(storage.path(pkey))

        def once() -> None:
            body = _body(storage, part.buffers)
            resource = self.client.upload(bucket, name, body)
            _check_resource(storage.url(pkey), resource, part.size, _encode(part_crc(part)))

        storage._call(f"upload part {storage.url(pkey)}", phase, once)

    def _upload_whole(
        self, storage: Storage, key: str, part: _Part, stream: ChecksummingWriter, phase: str
    ) -> None:
        bucket, name = _split(storage.path(key))

        def once() -> None:
            resource = self.client.upload(bucket, name, _body(storage, part.buffers))
            _check_resource(storage.url(key), resource, stream.size, stream.crc32c)

        storage._call(f"write {storage.url(key)}", phase, once)

    def _compose(
        self, storage: Storage, key: str, token: str, parts: list[_Part], stream: ChecksummingWriter
    ) -> None:
        sources = [part_key(key, token, i) for i in range(len(parts))]
        level = 0
        while len(sources) > COMPOSE_MAX_COMPONENTS:
            merged = []
            for g in range(0, len(sources), COMPOSE_MAX_COMPONENTS):
                target = f"{PARTS_DIRNAME}/{key}.{token}.c{level}-{g // COMPOSE_MAX_COMPONENTS}"
                self._compose_call(storage, target, sources[g : g + COMPOSE_MAX_COMPONENTS])
                merged.append(target)
            sources, level = merged, level + 1
        resource = self._compose_call(storage, key, sources)
        size = int(resource.get("size", -1))
        remote = resource.get("crc32c")
        if size != stream.size or remote != stream.crc32c:
            # Parts changed between their upload and the compose (or the server combined
            # them wrongly): never let this object be committed.
            raise WriteVerificationError(
                f"{storage.url(key)}: composed object has {size} bytes, crc32c {remote}; "
                f"streamed {stream.size} bytes, crc32c {stream.crc32c}. A part was altered "
                "after its upload; this save fails and the object must not be used."
            )

    def _compose_call(self, storage: Storage, key: str, sources: list[str]) -> dict[str, Any]:
        bucket, name = _split(storage.path(key))
        names = [_split(storage.path(s))[1] for s in sources]
        return storage._call(
            f"compose {storage.url(key)} from {len(names)} parts",
            "compose",
            lambda: self.client.compose(bucket, name, names),
        )

    def _remove_parts(self, storage: Storage, key: str, token: str, count: int) -> None:
        """Delete the temporary parts (and intermediate composites); best effort, logged."""
        keys = [part_key(key, token, i) for i in range(count)]
        n, level = count, 0
        while n > COMPOSE_MAX_COMPONENTS:
            groups = -(-n // COMPOSE_MAX_COMPONENTS)
            keys += [f"{PARTS_DIRNAME}/{key}.{token}.c{level}-{g}" for g in range(groups)]
            n, level = groups, level + 1

        def remove(pkey: str) -> None:
            bucket, name = _split(storage.path(pkey))
            storage._call(
                f"delete part {storage.url(pkey)}",
                "cleanup",
                lambda: self.client.delete(bucket, name),
            )

        failures = []
        for pkey, future in [(k, self._executor().submit(remove, k)) for k in keys]:
            try:
                future.result()
            except Exception as exc:  # never hide the write's own outcome
                failures.append((pkey, exc))
        if failures:
            logger.warning(
                "gcs: could not delete %d temporary part(s) of %s (first: %s: %s); they sit "
                "in %s/ and go with the checkpoint directory (python -m ckpt gc)",
                len(failures),
                storage.url(key),
                type(failures[0][1]).__name__,
                failures[0][1],
                storage.url(PARTS_DIRNAME),
            )

    # -- reads ------------------------------------------------------------------------

    def read_range(
        self, storage: Storage, key: str, start: int, end: int, phase: str
    ) -> bytearray | mmap.mmap:
        """Bytes ``[start, end)`` of ``key``, in parallel ranged requests when large.

        A large result is an anonymous ``mmap``: ``bytearray(n)`` zero-fills every page
        before the download writes it (0.07-0.09 s per 128 MiB here).
        """
        out = _fresh_buffer(end - start)
        self.read_into(storage, key, start, memoryview(out), phase)
        return out

    def read_into(
        self, storage: Storage, key: str, start: int, into: memoryview, phase: str
    ) -> None:
        """Bytes ``[start, start + len(into))`` of ``key`` into ``into``: ranges of
        ``read_part_bytes`` in parallel (``workers``), each one retried storage call."""
        bucket, name = _split(storage.path(key))
        end = start + into.nbytes
        step = self.options.read_part_bytes

        def fetch(lo: int, hi: int) -> None:
            storage._call(
                f"read {storage.url(key)}[{lo}:{hi}]",
                phase,
                lambda: self.client.read_into(bucket, name, lo, into[lo - start : hi - start]),
            )

        if end - start <= step:
            if end > start:
                fetch(start, end)
            return
        futures = [
            self._executor().submit(fetch, lo, min(end, lo + step))
            for lo in range(start, end, step)
        ]
        errors = []
        for future in futures:
            try:
                future.result()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


def _fresh_buffer(nbytes: int) -> bytearray | mmap.mmap:
    """A writable buffer of ``nbytes`` whose pages are first touched by the download."""
    if nbytes < ZERO_COPY_MIN_BYTES:
        return bytearray(nbytes)
    return mmap.mmap(-1, nbytes)


def _split(path: str) -> tuple[str, str]:
    bucket, _, name = path.strip("/").partition("/")
    if not name:
        raise StorageError(f"gs://{path}: not an object path (bucket/object expected)")
    return bucket, name


def _check_resource(url: str, resource: dict[str, Any], size: int, crc: str) -> None:
    got_size = int(resource.get("size", -1))
    got_crc = resource.get("crc32c")
    if got_size != size or (got_crc and got_crc != crc):
        raise WriteVerificationError(
            f"{url}: the server stored {got_size} bytes with crc32c {got_crc}; sent {size} "
            f"bytes with crc32c {crc}"
        )


def _body(storage: Storage, buffers: list[memoryview | bytes]) -> list[memoryview | bytes]:
    """The body to send: the buffers, or what an armed ``truncate`` fault leaves of them."""
    return storage.faults.body(buffers) if storage.faults.armed else buffers


__all__ = [
    "COMPOSE_MAX_COMPONENTS",
    "PARTS_DIRNAME",
    "GcsClient",
    "GcsHttpError",
    "GcsTransfer",
    "GcsTransferOptions",
    "PartSink",
    "is_part_key",
    "part_key",
]
