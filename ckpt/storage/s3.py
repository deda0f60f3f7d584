"""The S3 backend (``s3://bucket/prefix``): botocore for object bytes, s3fs for the rest.

Object bytes go through one botocore client per process (threads share it), with the
zero-copy part cutting of :mod:`ckpt.storage.parts`:

- An object of at most ``parallel_min_bytes`` is one ``PutObject``; a larger one a
  multipart upload whose parts (``part_bytes``) go up in parallel (``workers``) while
  the producer is still serializing. Nothing is renamed or copied: the object appears
  whole when the upload completes, and a failed upload is aborted (its parts were
  never visible).
- Checksums: every request carries the CRC32C of its bytes (``ChecksumAlgorithm=CRC32C``,
  computed from the held buffers, which the stream's crc32c already covers for a
  single request). S3 refuses a body that does not match (``BadDigest``). A multipart
  upload is a ``FULL_OBJECT`` CRC32C upload: S3 combines the parts' CRC32C into the
  whole object's and checks it against the one sent at completion. After each write a
  ``HeadObject`` (``ChecksumMode=ENABLED``) must show the size and CRC32C that were
  streamed, i.e. what the manifest records; the parts are checked the same way with
  one ``ListParts`` before the upload completes, and a bad part is sent again alone. These
  reads make the check hold on S3-compatible servers that store a client's checksum
  without verifying it (moto does, for single requests, and lists parts without
  theirs: there the part's size is checked, and the whole object's CRC32C, which moto
  computes from the bytes of a multipart upload).
- Reads: ranged ``GetObject`` requests, ``read_part_bytes`` each, ``workers`` in
  parallel, straight into the caller's buffer.
- Retries and timeouts are :class:`~ckpt.storage.Storage`'s: botocore's own retries
  are off (for s3fs's client too, unless ``fs_kwargs`` say otherwise; s3fs still
  retries a throttled listing a few times itself), so a failed data request is retried
  under one policy, and fault injection sees every attempt.

Listings, ``info`` of prefixes, deletes and copies (quarantine moves) use s3fs with the
same ``fs_kwargs``. S3 lists no checksums; :meth:`S3Backend.info` of an object reports
its CRC32C (one ``HeadObject``).

Configuration: credentials, region and endpoint come from botocore's usual chain
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE``,
``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, instance roles) or
from ``StorageOptions(fs_kwargs=...)`` in s3fs' terms (``key``, ``secret``, ``token``,
``endpoint_url``, ``client_kwargs={"region_name": ...}``, ``config_kwargs``, ``anon``).
Tuning: :class:`S3TransferOptions` as ``StorageOptions(transfer=...)``. Permissions and
a worked setup: examples/recipes/s3.md.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec

from ckpt.defaults import process_defaults
from ckpt.errors import (
    ObjectNotFoundError,
    RecordConflict,
    StoragePermanentError,
    WriteVerificationError,
)
from ckpt.format.checksum import ChecksummingWriter, encode_crc32c
from ckpt.format.manifest import MAX_MARKER_BYTES
from ckpt.storage.base import Calls
from ckpt.storage.parts import (
    ParallelTransfer,
    Part,
    TransferBackend,
    part_crc,
    read_exactly_into,
    transfer_options,
)

logger = logging.getLogger(__name__)

MIB = 1 << 20
MIN_PART_BYTES = 5 * MIB
"""S3 refuses parts smaller than 5 MiB (but the last)."""
MAX_PART_BYTES = 5 << 30
MAX_PUT_BYTES = 5 << 30
"""S3 refuses one ``PutObject`` or one part larger than 5 GiB."""
MAX_PARTS = 10_000
"""S3 refuses a multipart upload of more parts."""
PART_CHECKS = 3
"""Listings of an upload's parts (each followed by sending the bad ones again) before
its write fails."""
TRANSIENT_CODES = frozenset(
    {
        "BadDigest",  # the body did not match its checksum: corrupted in transit
        "IncompleteBody",
        "InternalError",
        "OperationAborted",
        "RequestLimitExceeded",
        "RequestTimeout",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
    }
)
"""S3 error codes a retry may cure, whatever their HTTP status (RequestTimeout is a 400)."""
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NoSuchUpload", "NotFound", "404"})
_S3FS_RETRYABLE_ERRNO = frozenset({errno.EBUSY, getattr(errno, "EREMOTEIO", errno.EIO)})
"""s3fs turns a 503 (``SlowDown``) into ``OSError(EBUSY)`` and a 500 into ``EREMOTEIO``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class S3TransferOptions:
    """How S3 objects are cut into parallel requests (multipart uploads, ranged reads).

    The defaults follow AWS's guidance for throughput (parts and ranges of 8-16 MB,
    many connections) scaled for checkpoint shards: 32 MiB parts keep an object of up
    to 312 GiB under S3's 10,000 parts.
    """

    parallel_min_bytes: int = 64 * MIB
    """Objects larger than this go up as a multipart upload; others in one ``PutObject``."""
    part_bytes: int = 32 * MIB
    """Size of a part (the last one may be shorter); 5 MiB to 5 GiB."""
    workers: int = 8
    """Parallel requests per process (part uploads, ranged reads)."""
    read_part_bytes: int = 16 * MIB
    """Ranged reads larger than this are split into parallel requests of this size."""

    def __post_init__(self) -> None:
        if not 0 <= self.parallel_min_bytes <= MAX_PUT_BYTES:
            raise ValueError(
                f"parallel_min_bytes must be 0..{MAX_PUT_BYTES} (S3's largest PutObject), "
                f"got {self.parallel_min_bytes}"
            )
        if not MIN_PART_BYTES <= self.part_bytes <= MAX_PART_BYTES:
            raise ValueError(
                f"part_bytes must be {MIN_PART_BYTES}..{MAX_PART_BYTES} (S3's part sizes), "
                f"got {self.part_bytes}"
            )
        if self.workers < 1 or self.read_part_bytes < 1:
            raise ValueError(
                f"workers and read_part_bytes must be >= 1, got {self.workers}, "
                f"{self.read_part_bytes}"
            )


class S3Error(OSError):
    """An S3 request answered with an error: ``code`` is the HTTP status, ``s3_code`` S3's
    error code, ``retryable`` whether another attempt may succeed."""

    def __init__(self, status: int, s3_code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {s3_code}: {message}")
        self.code = status
        self.s3_code = s3_code
        self.retryable = s3_code in TRANSIENT_CODES or status in _TRANSIENT_STATUS


@contextlib.contextmanager
def translated(url: str) -> Iterator[None]:
    """Turn botocore's exceptions into the taxonomy :class:`~ckpt.storage.Storage` reads:
    ``FileNotFoundError``, ``PermissionError``, :class:`S3Error`, ``TimeoutError``,
    ``ConnectionError``."""
    import botocore.exceptions as bx

    try:
        yield
    except bx.ClientError as exc:
        error = exc.response.get("Error", {})
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        code = str(error.get("Code") or status)
        message = f"{url}: {error.get('Message') or exc}"
        if code in _NOT_FOUND_CODES or status == 404:
            raise FileNotFoundError(f"{message} ({code})") from exc
        if status in (401, 403):
            raise PermissionError(f"{message} ({code})") from exc
        raise S3Error(status, code, message) from exc
    except (bx.ConnectTimeoutError, bx.ReadTimeoutError) as exc:
        raise TimeoutError(f"{url}: {exc}") from exc
    except (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError) as exc:
        raise ConnectionError(f"{url}: {type(exc).__name__}: {exc}") from exc
    except OSError as exc:
        if exc.errno in _S3FS_RETRYABLE_ERRNO and not hasattr(exc, "retryable"):
            exc.retryable = True  # type: ignore[attr-defined]
        raise
    except bx.NoCredentialsError as exc:
        raise PermissionError(
            f"{url}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or an instance role)"
        ) from exc


class _Buffers(io.RawIOBase):
    """A request body over held buffers: read without copies (views), seekable for
    botocore (which may hash the payload and rewinds)."""

    def __init__(self, buffers: list[memoryview | bytes]) -> None:
        self._views = [memoryview(b).cast("B") for b in buffers]
        self._views = [v for v in self._views if v.nbytes]
        self._size = sum(v.nbytes for v in self._views)
        self._pos = 0
        self._index = 0
        self._offset = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = min(max(0, base + offset), self._size)
        self._index, self._offset, left = 0, 0, self._pos
        while self._index < len(self._views) and left >= self._views[self._index].nbytes:
            left -= self._views[self._index].nbytes
            self._index += 1
        self._offset = left
        return self._pos

    def read(self, size: int = -1) -> Any:
        if size is None or size < 0:  # the rest, in one piece (a copy: nothing here asks)
            rest = [bytes(self.read(self._size))]
            while rest[-1]:
                rest.append(bytes(self.read(self._size)))
            return b"".join(rest)
        if self._index >= len(self._views):
            return b""
        view = self._views[self._index]
        n = size
        piece = view[self._offset : self._offset + n]
        self._offset += piece.nbytes
        self._pos += piece.nbytes
        if self._offset == view.nbytes:
            self._index, self._offset = self._index + 1, 0
        return piece  # a view: http.client and hashlib take it as it is

    def readinto(self, into: Any) -> int:
        piece = self.read(memoryview(into).nbytes)
        memoryview(into)[: piece.nbytes if piece else 0] = piece
        return len(piece)


_CLIENT_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SESSION_TOKEN",
)
"""What botocore reads from the environment when a client is made: a client made under
other values is not reused."""


def _cached_client(profile: str | None, init: dict[str, Any], config: dict[str, Any]) -> Any:
    """The botocore client of these settings in this process, kept in ``ckpt.defaults``.

    A new botocore session loads the S3 service model again (about half a second, for
    every ``Storage`` built); a client of a loaded session takes milliseconds. The
    process id is part of the keys: a forked child makes its own (sockets are not
    shared).
    """
    import botocore.session
    from botocore.config import Config

    defaults = process_defaults()
    pid = os.getpid()
    session = defaults.part(
        ("s3.session", pid, profile), lambda: botocore.session.Session(profile=profile)
    )
    environ = tuple(os.environ.get(name) for name in _CLIENT_ENV)
    key = ("s3.client", pid, profile, repr(sorted(init.items())), repr(sorted(config.items())))
    return defaults.part(
        (*key, environ), lambda: session.create_client("s3", config=Config(**config), **init)
    )


def _body(buffers: list[memoryview | bytes], crc: str) -> dict[str, Any]:
    """The body arguments of an upload: the held buffers and their CRC32C."""
    reader = _Buffers(buffers)
    return {
        "Body": reader,
        "ContentLength": len(reader),
        "ChecksumAlgorithm": "CRC32C",
        "ChecksumCRC32C": crc,
    }


class S3Client:
    """The few S3 calls the checkpoint needs, on one botocore client per process and
    settings (threads share it)."""

    def __init__(self, fs: Any, timeout_s: float, connections: int) -> None:
        self._fs = fs
        self._timeout_s = timeout_s
        self._connections = connections

    @property
    def client(self) -> Any:
        """The botocore client of the s3fs filesystem's settings (one per process)."""
        fs = self._fs
        config = dict(fs.config_kwargs)
        config.setdefault("connect_timeout", min(self._timeout_s, 10.0))
        config.setdefault("read_timeout", self._timeout_s)
        config.setdefault("max_pool_connections", self._connections)
        config["retries"] = {"total_max_attempts": 1}  # Storage retries
        # Checksums are ours (CRC32C, sent and checked); botocore adds none of its own.
        config.setdefault("request_checksum_calculation", "when_required")
        config.setdefault("response_checksum_validation", "when_required")
        init = {
            "aws_access_key_id": fs.key,
            "aws_secret_access_key": fs.secret,
            "aws_session_token": fs.token,
            "endpoint_url": fs.endpoint_url,
        }
        init = {k: v for k, v in init.items() if v is not None}
        init.update(fs.client_kwargs)
        if fs.anon:
            from botocore import UNSIGNED

            config["signature_version"] = UNSIGNED
            for name in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token"):
                init.pop(name, None)
        return _cached_client(fs.kwargs.get("profile"), init, config)

    def head(self, bucket: str, key: str) -> dict[str, Any]:
        """Size and, where the object has one, its full-object CRC32C."""
        answer = self.client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        crc = answer.get("ChecksumCRC32C")
        info: dict[str, Any] = {
            "name": f"{bucket}/{key}",
            "size": int(answer["ContentLength"]),
            "type": "file",
        }
        if crc and answer.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT":
            info["crc32c"] = crc  # a COMPOSITE one ("...-N") is not the bytes' crc32c
        return info

    def put(self, bucket: str, key: str, body: list[memoryview | bytes], crc: str) -> None:
        self.client.put_object(Bucket=bucket, Key=key, **_body(body, crc))

    def start_multipart(self, bucket: str, key: str) -> str:
        answer = self.client.create_multipart_upload(
            Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32C", ChecksumType="FULL_OBJECT"
        )
        return str(answer["UploadId"])

    def put_part(
        self, bucket: str, key: str, upload_id: str, number: int, body: list[Any], crc: str
    ) -> str:
        answer = self.client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, **_body(body, crc)
        )
        return str(answer["ETag"])

    def parts(self, bucket: str, key: str, upload_id: str) -> dict[int, dict[str, Any]]:
        """What the server holds of an upload, by part number: ``Size``, ``ETag`` and, where
        it keeps one, ``ChecksumCRC32C``."""
        held: dict[int, dict[str, Any]] = {}
        pages = self.client.get_paginator("list_parts")
        for page in pages.paginate(Bucket=bucket, Key=key, UploadId=upload_id):
            held.update((int(p["PartNumber"]), p) for p in page.get("Parts", []))
        return held

    def complete(
        self, bucket: str, key: str, upload_id: str, parts: list[dict[str, Any]], crc: str
    ) -> None:
        self.client.complete_multipart_upload(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
            ChecksumCRC32C=crc,
            ChecksumType="FULL_OBJECT",
        )

    def abort(self, bucket: str, key: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        except self.client.exceptions.NoSuchUpload:
            pass

    def get(self, bucket: str, key: str, start: int, end: int | None) -> bytes:
        """Bytes ``[start, end)`` (``end=None``: to the end); fewer at the object's end."""
        if start == 0 and end is None:
            return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()
        last = "" if end is None else str(end - 1)
        try:
            answer = self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{last}")
        except self.client.exceptions.ClientError as exc:
            if start == 0 and exc.response.get("Error", {}).get("Code") == "InvalidRange":
                return b""  # an empty object has no byte 0
            raise
        return answer["Body"].read()

    def get_into(self, bucket: str, key: str, start: int, into: memoryview) -> None:
        """Exactly bytes ``[start, start + len(into))`` into ``into``."""
        end = start + into.nbytes - 1
        answer = self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end}")
        got = _fill_from(answer["Body"], into)
        if got != into.nbytes:
            raise WriteVerificationError(
                f"s3://{bucket}/{key}: short read, asked bytes [{start}, {end + 1}) got {got}"
            )


def _fill_from(body: Any, into: memoryview) -> int:
    """Read a ``GetObject`` body into ``into``; how many bytes came.

    botocore's ``readinto`` goes through urllib3's, which reads into a new bytes object
    and copies it over: on a load that is one more pass over every byte, on the cores
    that also verify and place them. Where the body is urllib3's response over
    ``http.client`` with no content decoding, the bytes are read from ``http.client``
    straight into ``into``, and the connection goes back to the pool once the response
    is complete (urllib3 does the same when it reads to the end itself). Anything else
    takes botocore's path.
    """
    raw = getattr(body, "_raw_stream", None)
    response = getattr(raw, "_original_response", None)
    if (
        response is None
        or not hasattr(response, "readinto")
        or raw.headers.get("content-encoding") not in (None, "", "identity")
    ):
        return read_exactly_into(body, into)
    try:
        got = read_exactly_into(response, into)
    except BaseException:
        raw.close()  # part-read: the connection cannot be reused
        raise
    if response.isclosed():
        raw.release_conn()
    else:
        raw.close()  # more bytes than asked for: drop the connection, not read them
    return got


class _Upload:
    """One multipart upload in flight: its id, the phase its parts are sent in, the parts
    sent so far."""

    def __init__(self, upload_id: str, phase: str) -> None:
        self.upload_id = upload_id
        self.phase = phase
        self.sent: dict[int, dict[str, Any]] = {}
        self.lock = threading.Lock()


class S3Transfer(ParallelTransfer):
    """Zero-copy ``PutObject`` / parallel multipart uploads and parallel ranged reads."""

    scheme = "s3"

    def __init__(self, client: S3Client, options: S3TransferOptions) -> None:
        super().__init__(options)
        self.client = client

    @staticmethod
    def _check(url: str, got_size: int, got_crc: str | None, size: int, crc: str) -> None:
        """The server must hold ``size`` bytes, and the CRC32C sent where it reports one
        (S3 does for objects and parts; an S3-compatible server may keep none)."""
        if got_size != size or (got_crc is not None and got_crc != crc):
            raise WriteVerificationError(
                f"{url}: the server holds {got_size} bytes with crc32c {got_crc}; sent {size} "
                f"bytes with crc32c {crc}"
            )

    def put_whole(
        self, path: str, part: Part, stream: ChecksummingWriter, calls: Calls, phase: str
    ) -> None:
        bucket, key = split(path)
        url = self.url(path)

        def once() -> None:
            with translated(url):
                self.client.put(bucket, key, calls.body(part.buffers), stream.crc32c)
                held = self.client.head(bucket, key)
            self._check(url, held["size"], held.get("crc32c"), stream.size, stream.crc32c)

        calls.call(f"write {url}", phase, once)

    def start_parts(self, path: str, calls: Calls, phase: str) -> _Upload:
        bucket, key = split(path)
        url = self.url(path)

        def once() -> str:
            with translated(url):
                return self.client.start_multipart(bucket, key)

        # Like the completion, a request about the upload, not its bytes: shard faults
        # (``phase``) act on the parts, as on GCS's part uploads and compose.
        return _Upload(calls.call(f"start multipart upload {url}", "compose", once), phase)

    def put_part(
        self, upload: _Upload, path: str, index: int, part: Part, calls: Calls, phase: str
    ) -> None:
        number = index + 1
        if number > MAX_PARTS:
            raise StoragePermanentError(
                f"{self.url(path)}: more than {MAX_PARTS} parts of {self.options.part_bytes} "
                "bytes (S3's limit); raise S3TransferOptions.part_bytes"
            )
        bucket, key = split(path)
        url = f"{self.url(path)} part {number}"
        crc = encode_crc32c(part_crc(part))

        def once() -> None:
            with translated(url):
                body = calls.body(part.buffers)
                etag = self.client.put_part(bucket, key, upload.upload_id, number, body, crc)
            with upload.lock:
                upload.sent[number] = {"PartNumber": number, "ETag": etag, "ChecksumCRC32C": crc}

        calls.call(f"upload {url}", phase, once)

    def _check_parts(self, upload: _Upload, path: str, parts: list[Part], calls: Calls) -> None:
        """Every part as the server holds it must have the size (and CRC32C, where it keeps
        one) that was sent; a part that does not is sent again, alone.

        One listing once every part is up (not one per part while others upload: moto
        computes a part's ETag lazily, unlocked, and concurrent requests on one part
        cached a wrong one, which then failed the completion as ``InvalidPart``).
        """
        bucket, key = split(path)
        url = self.url(path)

        def listing() -> dict[int, dict[str, Any]]:
            with translated(url):
                return self.client.parts(bucket, key, upload.upload_id)

        for _ in range(PART_CHECKS):
            held = calls.call(f"list parts {url}", "compose", listing)
            bad = []
            for number, part in enumerate(parts, 1):
                got = held.get(number, {})
                try:
                    self._check(
                        f"{url} part {number}",
                        int(got.get("Size", -1)),
                        got.get("ChecksumCRC32C"),
                        part.size,
                        encode_crc32c(part_crc(part)),
                    )
                except WriteVerificationError as exc:
                    logger.warning("s3: %s; sending that part again", exc)
                    bad.append(number)
            if not bad:
                return
            for number in bad:
                self.put_part(upload, path, number - 1, parts[number - 1], calls, upload.phase)
        raise WriteVerificationError(
            f"{url}: parts {bad} still differ from what was sent after {PART_CHECKS} checks"
        )

    def finish_parts(
        self,
        upload: _Upload,
        path: str,
        parts: list[Part],
        stream: ChecksummingWriter,
        calls: Calls,
    ) -> None:
        bucket, key = split(path)
        url = self.url(path)
        self._check_parts(upload, path, parts, calls)
        sent = [upload.sent[n] for n in sorted(upload.sent)]
        if len(sent) != len(parts):
            raise WriteVerificationError(f"{url}: {len(sent)} of {len(parts)} parts were sent")

        def complete() -> None:
            with translated(url):
                self.client.complete(bucket, key, upload.upload_id, sent, stream.crc32c)

        try:
            calls.call(f"complete multipart upload {url}", "compose", complete)
        except ObjectNotFoundError:
            pass  # an attempt whose answer was lost completed it: the check below decides

        def head() -> dict[str, Any]:
            with translated(url):
                return self.client.head(bucket, key)

        held = calls.call(f"stat {url}", "compose", head)
        try:
            self._check(url, held["size"], held.get("crc32c"), stream.size, stream.crc32c)
        except WriteVerificationError as exc:
            # S3 combined the parts into other bytes than were streamed: never let this
            # object be committed.
            raise WriteVerificationError(
                f"{exc}. The assembled object differs from what was streamed; this save "
                "fails and the object must not be used."
            ) from None

    def end_parts(
        self, upload: _Upload, path: str, count: int, finished: bool, calls: Calls
    ) -> None:
        """Abort an upload that did not complete, so that its parts stop costing storage."""
        if finished:
            return
        bucket, key = split(path)
        url = self.url(path)

        def abort() -> None:
            with translated(url):
                self.client.abort(bucket, key, upload.upload_id)

        try:
            calls.call(f"abort multipart upload {url}", "cleanup", abort)
        except Exception as exc:  # never hide the write's own outcome
            logger.warning(
                "s3: could not abort the multipart upload of %s (%s: %s); its parts stay "
                "invisible and billed until a lifecycle rule (AbortIncompleteMultipartUpload) "
                "removes them",
                url,
                type(exc).__name__,
                exc,
            )

    def get_range_into(self, path: str, start: int, into: memoryview) -> None:
        bucket, key = split(path)
        with translated(self.url(path)):
            self.client.get_into(bucket, key, start, into)


class S3Backend(TransferBackend):
    """A :class:`~ckpt.storage.base.Backend` for ``s3://``."""

    @classmethod
    def open(cls, url: str, options: Any) -> tuple[S3Backend, str]:
        tuning = transfer_options(options, S3TransferOptions, url)
        kwargs = dict(options.fs_kwargs)
        config = dict(kwargs.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1})  # Storage retries
        kwargs["config_kwargs"] = config
        fs, path = fsspec.core.url_to_fs(url, **kwargs)
        client = S3Client(fs, options.timeout_s, tuning.workers * 2 + 2)
        return cls(fs, options, S3Transfer(client, tuning)), path

    def read(self, path: str, start: int, end: int | None) -> Any:
        bucket, key = split(path)
        with translated(self.url(path)):
            return self.transfer.client.get(bucket, key, start, end)

    def info(self, path: str) -> dict[str, Any]:
        bucket, _, key = path.strip("/").partition("/")
        if key:
            try:
                with translated(self.url(path)):
                    return self.transfer.client.head(bucket, key)
            except FileNotFoundError:
                pass  # maybe a prefix: s3fs says so (or that nothing is there)
        with translated(self.url(path)):
            return super().info(path)

    def list_dir(self, path: str) -> list[tuple[str, str]]:
        with translated(self.url(path)):
            return super().list_dir(path)

    def list_files(self, path: str) -> dict[str, dict[str, Any]]:
        with translated(self.url(path)):
            return super().list_files(path)

    def remove(self, path: str) -> None:
        with translated(self.url(path)):
            super().remove(path)

    def remove_tree(self, path: str) -> None:
        with translated(self.url(path)):
            super().remove_tree(path)

    def conditional_record(self, path: str) -> S3Record:
        return S3Record(self.transfer.client.client, path, self.url(path))

    def copy(self, src: str, dst: str) -> None:
        with translated(self.url(src)):
            super().copy(src, dst)


def split(path: str) -> tuple[str, str]:
    """``bucket/key`` -> ``(bucket, key)``."""
    bucket, _, key = path.strip("/").partition("/")
    if not key:
        raise StoragePermanentError(f"s3://{path}: not an object path (bucket/key expected)")
    return bucket, key


class S3Record:
    """A :class:`~ckpt.storage.base.ConditionalRecord` on S3: one object written with
    ``If-None-Match: *`` (absent) or ``If-Match: ETag`` (S3's conditional writes), removed
    with ``If-Match``; the version is the ETag."""

    def __init__(self, client: Any, path: str, url: str) -> None:
        self.client = client  # the backend's botocore client
        self.bucket, _, self.key = path.strip("/").partition("/")
        self.url = url

    def read(self) -> tuple[bytes | None, Any]:
        try:
            with translated(self.url):
                answer = self.client.get_object(Bucket=self.bucket, Key=self.key)
                return answer["Body"].read(MAX_MARKER_BYTES + 1), answer["ETag"]
        except FileNotFoundError:
            return None, ""

    def write(self, data: bytes, version: Any) -> Any:
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
                raise RecordConflict() from None
            raise
        return answer["ETag"]

    def delete(self, version: Any) -> None:
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
