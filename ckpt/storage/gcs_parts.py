"""GCS objects at line rate: zero-copy uploads, parallel parts + compose, parallel ranged reads.

:class:`~ckpt.storage.gcs.GcsBackend` sends every ``gs://`` object write and ranged
read through here (JSON API over plain ``http.client``, credentials and endpoint from
the gcsfs filesystem the backend already holds; the part cutting and the parallel
requests are :mod:`ckpt.storage.parts`, shared with S3):

- Writes: the bytes a producer streams are *held*, not copied: a buffer of at least
  ``ckpt.storage.parts.ZERO_COPY_MIN_BYTES`` becomes a ``memoryview`` that is sent as the request body
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
  :class:`~ckpt.errors.WriteVerificationError`: that part is sent again); the composed
  object's server-reported crc32c (GCS combines the parts') must equal the crc32c streamed for the whole object (what the manifest records),
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

Why: gcsfs copies each byte into its upload buffers and again per request, which makes
its ``pipe`` of a large object many times slower than one ``http.client`` request with a
memoryview body (bench ``gcs``; see BENCHMARKS.md).

Tuning: :class:`GcsTransferOptions`, passed as ``StorageOptions(transfer=...)`` (or
``StorageOptions(gcs=...)``).
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import queue
import threading
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from ckpt.errors import StorageError, WriteVerificationError
from ckpt.format.checksum import ChecksummingWriter
from ckpt.storage.base import Calls
from ckpt.storage.parts import ParallelTransfer, Part, PartSink, part_crc, read_exactly_into

logger = logging.getLogger(__name__)

PARALLEL_MIN_BYTES = 150 << 20
PART_BYTES = 50 << 20
"""Threshold and part size: the defaults of ``gcloud storage``'s parallel composite
uploads (``parallel_composite_upload_threshold`` 150M, ``..._component_size`` 50M)."""
WORKERS = 4
READ_PART_BYTES = 16 << 20
COMPOSE_MAX_COMPONENTS = 32
"""GCS accepts at most 32 source objects per compose request."""
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
                got = read_exactly_into(response, into)
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


def _encode(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


class GcsTransfer(ParallelTransfer):
    """Parallel, zero-copy object transfers for ``gs://`` (a connection pool and a thread
    pool, shared by a storage and its children)."""

    scheme = "gs"

    def __init__(self, fs: Any, options: GcsTransferOptions, timeout_s: float) -> None:
        super().__init__(options)
        self.client = GcsClient(fs, timeout_s)

    def put_whole(
        self, path: str, part: Part, stream: ChecksummingWriter, calls: Calls, phase: str
    ) -> None:
        bucket, name = _split(path)

        def once() -> None:
            resource = self.client.upload(bucket, name, calls.body(part.buffers))
            _check_resource(self.url(path), resource, stream.size, stream.crc32c)

        calls.call(f"write {self.url(path)}", phase, once)

    def start_parts(self, path: str, calls: Calls, phase: str) -> str:
        return uuid.uuid4().hex[:12]  # names this upload's temporary part objects

    def put_part(
        self, upload: str, path: str, index: int, part: Part, calls: Calls, phase: str
    ) -> None:
        ppath = _part_path(path, upload, index)
        bucket, name = _split(ppath)

        def once() -> None:
            resource = self.client.upload(bucket, name, calls.body(part.buffers))
            _check_resource(self.url(ppath), resource, part.size, _encode(part_crc(part)))

        calls.call(f"upload part {self.url(ppath)}", phase, once)

    def finish_parts(
        self,
        upload: str,
        path: str,
        parts: list[Part],
        stream: ChecksummingWriter,
        calls: Calls,
    ) -> None:
        sources = [_part_path(path, upload, i) for i in range(len(parts))]
        level = 0
        while len(sources) > COMPOSE_MAX_COMPONENTS:
            merged = []
            for g in range(0, len(sources), COMPOSE_MAX_COMPONENTS):
                target = _composite_path(path, upload, level, g // COMPOSE_MAX_COMPONENTS)
                self._compose_call(target, sources[g : g + COMPOSE_MAX_COMPONENTS], calls)
                merged.append(target)
            sources, level = merged, level + 1
        resource = self._compose_call(path, sources, calls)
        size = int(resource.get("size", -1))
        remote = resource.get("crc32c")
        if size != stream.size or remote != stream.crc32c:
            # Parts changed between their upload and the compose (or the server combined
            # them wrongly): never let this object be committed.
            raise WriteVerificationError(
                f"{self.url(path)}: composed object has {size} bytes, crc32c {remote}; "
                f"streamed {stream.size} bytes, crc32c {stream.crc32c}. A part was altered "
                "after its upload; this save fails and the object must not be used."
            )

    def _compose_call(self, path: str, sources: list[str], calls: Calls) -> dict[str, Any]:
        bucket, name = _split(path)
        names = [_split(s)[1] for s in sources]
        return calls.call(
            f"compose {self.url(path)} from {len(names)} parts",
            "compose",
            lambda: self.client.compose(bucket, name, names),
        )

    def end_parts(self, upload: str, path: str, count: int, finished: bool, calls: Calls) -> None:
        """Delete the temporary parts (and intermediate composites), also after a failure;
        best effort, logged."""
        paths = [_part_path(path, upload, i) for i in range(count)]
        n, level = count, 0
        while n > COMPOSE_MAX_COMPONENTS:
            groups = -(-n // COMPOSE_MAX_COMPONENTS)
            paths += [_composite_path(path, upload, level, g) for g in range(groups)]
            n, level = groups, level + 1

        def remove(ppath: str) -> None:
            bucket, name = _split(ppath)
            calls.call(
                f"delete part {self.url(ppath)}",
                "cleanup",
                lambda: self.client.delete(bucket, name),
            )

        failures = []
        for ppath, future in [(p, self.executor().submit(remove, p)) for p in paths]:
            try:
                future.result()
            except Exception as exc:  # never hide the write's own outcome
                failures.append((ppath, exc))
        if failures:
            logger.warning(
                "gcs: could not delete %d temporary part(s) of %s (first: %s: %s); they sit "
                "in %s/ and go with the checkpoint directory (python -m ckpt gc)",
                len(failures),
                self.url(path),
                type(failures[0][1]).__name__,
                failures[0][1],
                self.url(_parts_dir(path)),
            )

    def get_range_into(self, path: str, start: int, into: memoryview) -> None:
        bucket, name = _split(path)
        self.client.read_into(bucket, name, start, into)


def _parts_dir(path: str) -> str:
    """Where the temporary parts of the object ``path`` live: ``.parts/`` beside it."""
    return f"{path.rpartition('/')[0]}/{PARTS_DIRNAME}"


def _part_path(path: str, token: str, index: int) -> str:
    parent, _, name = path.rpartition("/")
    return f"{parent}/{part_key(name, token, index)}"


def _composite_path(path: str, token: str, level: int, group: int) -> str:
    return f"{_parts_dir(path)}/{path.rpartition('/')[2]}.{token}.c{level}-{group}"


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


__all__ = [
    "COMPOSE_MAX_COMPONENTS",
    "PARTS_DIRNAME",
    "GcsClient",
    "GcsHttpError",
    "GcsTransfer",
    "GcsTransferOptions",
    "PartSink",
    "is_part_key",
    "part_crc",
    "part_key",
]
